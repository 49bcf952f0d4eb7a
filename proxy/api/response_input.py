"""The input items of a Responses body, checked with JSON paths (SPEC §12.1): what the proxy
reads of each item must have the right type; the rest is never sent anywhere."""

from __future__ import annotations

from typing import Any

from proxy.api.body_fields import name, object_field, string
from proxy.errors import InvalidRequest

ROLES = frozenset({"user", "system", "developer", "assistant"})
PART_TYPES = frozenset(
    {"input_text", "output_text", "input_image", "input_file", "refusal", "summary_text"}
)
TEXT_PARTS = frozenset({"input_text", "output_text", "summary_text"})
# Items that record what a hosted tool or reasoning did: accepted, never sent upstream.
SKIPPED_ITEMS = frozenset(
    {
        "reasoning",
        "web_search_call",
        "file_search_call",
        "code_interpreter_call",
        "image_generation_call",
        "computer_call",
        "computer_call_output",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "tool_search_call",
        "tool_search_output",
        "compaction",
    }
)
ITEM_TYPES = frozenset(
    {
        "message",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "custom_tool_call_output",
        "mcp_call",
        "item_reference",
    }
)


def checked_input(value: Any, has_previous: bool) -> list[dict[str, Any]]:
    if value is None:
        if has_previous:
            return []
        raise InvalidRequest("input is required: a string or a list of items", param="input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequest("input must be a string or a list of items", param="input")
    for i, item in enumerate(value):
        if isinstance(item, dict) and "type" not in item and "role" not in item and "id" in item:
            item["type"] = "item_reference"  # its `type` is optional, as a message's is
        _item(item, f"input[{i}]")
    return value


def _item(item: Any, path: str) -> None:
    """Checks what the proxy reads of an item; the rest of it is not sent anywhere."""
    item = object_field(item, path)
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"
    if not isinstance(kind, str):
        raise InvalidRequest("type must be a string", param=f"{path}.type")
    if kind in SKIPPED_ITEMS:
        return
    if kind not in ITEM_TYPES:
        raise InvalidRequest(f"unknown item type {kind[:64]!r}", param=f"{path}.type")
    if kind == "message":
        _message(item, path)
    elif kind == "item_reference":
        name(item.get("id"), f"{path}.id")
    elif kind == "mcp_call":
        for key in ("id", "name", "arguments"):
            string(item.get(key), f"{path}.{key}")
        if item.get("output") is not None:
            string(item["output"], f"{path}.output")
    else:
        name(item.get("call_id"), f"{path}.call_id")
        if kind == "function_call":
            string(item.get("name"), f"{path}.name")
            string(item.get("arguments"), f"{path}.arguments")
        elif kind == "custom_tool_call":
            string(item.get("name"), f"{path}.name")
            string(item.get("input"), f"{path}.input")
        else:
            _content(item.get("output"), f"{path}.output")
        namespace = item.get("namespace")
        if namespace is not None:
            string(namespace, f"{path}.namespace")


def _message(item: dict[str, Any], path: str) -> None:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest(
            f"role must be one of {', '.join(sorted(ROLES))}", param=f"{path}.role"
        )
    _content(item.get("content"), f"{path}.content")


def _content(content: Any, path: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest("must be a string or a list of parts", param=path)
    for j, part in enumerate(content):
        where = f"{path}[{j}]"
        part = object_field(part, where)
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in PART_TYPES:
            raise InvalidRequest(
                f"type must be one of {', '.join(sorted(PART_TYPES))}", param=f"{where}.type"
            )
        if kind in TEXT_PARTS:
            string(part.get("text"), f"{where}.text")
        elif kind == "input_image":
            _image(part, where)


def _image(part: dict[str, Any], where: str) -> None:
    """An image goes upstream by its URL (or data URL): Chat Completions takes no file id."""
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise InvalidRequest(
            "an image by file_id cannot go to a Chat Completions upstream; send image_url "
            "(a URL or a data URL)",
            param=f"{where}.file_id",
            code="unsupported_parameter",
        )
    if not isinstance(url, str) or not url:
        raise InvalidRequest(
            "must be a non-empty string (a URL or a data URL)", param=f"{where}.image_url"
        )
