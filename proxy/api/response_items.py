"""Responses items and the engine's Chat Completions messages, both ways (SPEC §12.1, §12.2).

Into the engine: a client's (or a stored response's) items become messages. Out of it: a run's
server calls, client calls and final message become `output` items. Both directions are linear
in the items and hold no state beyond one call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.api.response_body import cut_short
from proxy.engine import events as ev
from proxy.engine.run_spec import RunResult
from proxy.engine.values import ToolSpec, error_content

DEFAULT_SERVER_LABEL = "loopwarden"
CLIENT_CALLS = frozenset({"function_call", "custom_tool_call"})
CALL_ITEMS = frozenset({*CLIENT_CALLS, "mcp_call"})
OUTPUT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output"})
# The parameters of the function a `custom` tool becomes upstream: one free-text `input`.
CUSTOM_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
    "additionalProperties": False,
}


@dataclass(frozen=True, slots=True)
class ClientTool:
    """A client tool as the client named it: a `function` or a `custom` tool, maybe inside a
    `namespace`. Upstream it is one function named `upstream_name(name, namespace)`."""

    kind: str  # function | custom
    name: str
    namespace: str | None = None


# Upstream function name -> the client's tool, for the tools whose names differ or that are
# `custom`; any other name is a plain function of that name.
ToolNames = Mapping[str, ClientTool]


def upstream_name(name: str, namespace: str | None) -> str:
    """The flat function name the upstream sees for a tool in `namespace`."""
    if not namespace:
        return name
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


def server_label(spec: ToolSpec | None) -> str:
    """The `server_label` of a server tool's `mcp_call` items: the tool's MCP source, or
    `loopwarden` for the proxy's other tools."""
    return spec.source if spec is not None and spec.source else DEFAULT_SERVER_LABEL


# -- items into messages --------------------------------------------------------------------


def items_to_messages(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat Completions messages for validated input items: consecutive calls become one
    assistant message with `tool_calls`, joined to the assistant text right before them, or
    right after calls among which a client call is (a JSON response lists its server and
    client calls before its text: the text must not come between the calls and their
    outputs; after server calls alone it is the next step's); an `mcp_call`'s result follows
    that message, outputs become `tool` messages, `developer` becomes `system`. Items that have
    no upstream meaning (`reasoning`, hosted calls) are left out."""
    messages: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    said: list[Any] = []  # the assistant text after client calls, which it goes with
    client_called = False  # a client call is among `calls`

    def flush() -> None:
        nonlocal client_called
        last = messages[-1] if messages else None
        if (
            not said
            and last is not None
            and last["role"] == "assistant"
            and "tool_calls" not in last
        ):
            last["tool_calls"] = list(calls)
        else:
            text = said[0] if said else None
            messages.append({"role": "assistant", "content": text, "tool_calls": list(calls)})
        messages.extend(results)
        calls.clear()
        results.clear()
        said.clear()
        client_called = False

    for item in items:
        kind = item.get("type", "message")
        if kind in CALL_ITEMS:
            if said:
                flush()
            call, result = _call(item, kind)
            client_called = client_called or kind in CLIENT_CALLS
            calls.append(call)
            if result is not None:
                results.append(result)
            continue
        if kind == "message":
            message = _message(item)
            if client_called and not said and message["role"] == "assistant":
                said.append(message["content"])
                continue
            if calls:
                flush()
            messages.append(message)
        elif kind in OUTPUT_ITEMS:
            if calls:
                flush()
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])}
            )
    if calls:
        flush()
    return messages


def _call(item: dict[str, Any], kind: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if kind == "function_call":
        name, arguments = upstream_name(item["name"], item.get("namespace")), item["arguments"]
        call_id = item["call_id"]
    elif kind == "custom_tool_call":
        name = upstream_name(item["name"], item.get("namespace"))
        arguments = orjson.dumps({"input": item["input"]}).decode()
        call_id = item["call_id"]
    else:  # mcp_call: a server call that ran, with its result in the item
        name, arguments, call_id = item["name"], item["arguments"], item["id"]
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if kind != "mcp_call":
        return call, None
    error = item.get("error")
    content = error_content(_error_text(error)) if error is not None else item.get("output") or ""
    return call, {"role": "tool", "tool_call_id": call_id, "content": content}


def _message(item: dict[str, Any]) -> dict[str, Any]:
    role = item["role"]
    content = item["content"]
    if role == "developer":
        role = "system"
    if isinstance(content, str):
        return {"role": role, "content": content}
    if role != "user":  # system and assistant text stay plain strings: every upstream takes them
        return {"role": role, "content": _text(content)}
    return {"role": role, "content": [_part(p) for p in content]}


def _part(part: dict[str, Any]) -> dict[str, Any]:
    kind = part["type"]
    if kind == "input_image":
        image: dict[str, Any] = {"url": part.get("image_url") or ""}  # (`response_input`)
        if part.get("detail"):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file":
        file = {k: part[k] for k in ("file_data", "file_id", "filename") if part.get(k)}
        return {"type": "file", "file": file}
    return {"type": "text", "text": part.get("text") or part.get("refusal") or ""}


def _text(content: Any) -> str:
    """The text of a string or of a list of parts; other parts are named by their type."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            text = part.get("refusal") if isinstance(part, dict) else None
        texts.append(text if isinstance(text, str) else f"[{_kind(part)}]")
    return "\n".join(texts)


def _kind(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    return kind if isinstance(kind, str) else "part"


def _error_text(error: Any) -> str:
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str):
            return message
        content = error.get("content")
        if isinstance(content, list):
            return _text(content)
    return "the tool failed"


# -- a run into items -----------------------------------------------------------------------


class ServerCalls:
    """The `mcp_call` items of the server calls a run executes, in the order they started,
    built from the run's events (an observer for JSON runs; the stream feeds its own)."""

    def __init__(self, item_prefix: str, tools: Mapping[str, ToolSpec]) -> None:
        self.prefix = item_prefix
        self.tools = tools
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, dict[str, Any]] = {}

    def on_event(self, event: ev.RunEvent) -> None:
        if isinstance(event, ev.ToolStarted):
            self.started(event)
        elif isinstance(event, ev.ToolExecuted):
            self.executed(event)

    def started(self, event: ev.ToolStarted) -> dict[str, Any]:
        call = event.call
        item_id = f"mcp_{self.prefix}_{len(self.items)}"
        item = {
            "id": item_id,
            "type": "mcp_call",
            "status": "in_progress",
            "server_label": server_label(self.tools.get(call.name)),
            "name": call.name,
            "arguments": call.arguments,
            "output": None,
            "error": None,
        }
        self.items.append(item)
        self._open[call.id] = item
        return item

    def executed(self, event: ev.ToolExecuted) -> dict[str, Any] | None:
        item = self._open.pop(event.call.id, None)
        if item is None:
            return None
        result = event.result
        if result.is_error:
            item["status"] = "failed"
            item["error"] = _failure(result.output)
        else:
            item["status"] = "completed"
            item["output"] = result.output
        return item

    def unfinished(self) -> list[dict[str, Any]]:
        """Ends the calls that started but never finished (the run stopped meanwhile, e.g. at
        its time budget) as `incomplete`; gives them."""
        ended = list(self._open.values())
        self._open.clear()
        for item in ended:
            item["status"] = "incomplete"
            item["error"] = _failure(UNFINISHED)
        return ended


UNFINISHED = "The run stopped before this call finished."


def _failure(message: str) -> dict[str, Any]:
    return {
        "type": "mcp_tool_execution_error",
        "message": message,
        "content": [{"type": "text", "text": message}],
    }


def client_call_item(call: dict[str, Any], item_id: str, names: ToolNames) -> dict[str, Any]:
    """The `function_call` or `custom_tool_call` item of a client call of the model."""
    function = call["function"]
    tool = names.get(function["name"])
    if tool is None:
        return {
            "id": item_id,
            "type": "function_call",
            "status": "completed",
            "call_id": call["id"],
            "name": function["name"],
            "arguments": function["arguments"],
        }
    if tool.kind == "custom":
        item: dict[str, Any] = {
            "id": item_id,
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": call["id"],
            "name": tool.name,
            "input": custom_input(function["arguments"]),
        }
    else:
        item = {
            "id": item_id,
            "type": "function_call",
            "status": "completed",
            "call_id": call["id"],
            "name": tool.name,
            "arguments": function["arguments"],
        }
    if tool.namespace:
        item["namespace"] = tool.namespace
    return item


def custom_input(arguments: str) -> str:
    """A custom tool's free text from the JSON arguments of the function it is upstream; the
    arguments as they are when the model did not send `{"input": "..."}`."""
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
        return str(parsed["input"])
    return arguments


def client_items(result: RunResult, prefix: str, names: ToolNames) -> list[dict[str, Any]]:
    """The items of the client calls a run ends with (none unless it stopped for them)."""
    return [
        client_call_item(call, f"fc_{prefix}_{i}", names)
        for i, call in enumerate(result.message.get("tool_calls") or [])
    ]


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def refusal_item(item_id: str, refusal: str) -> dict[str, Any]:
    """A message holding the model's refusal, as OpenAI's Responses API gives it."""
    return {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "refusal", "refusal": refusal}],
    }


def refusal_of(result: RunResult) -> str | None:
    """The run's last reply's refusal, when it has one."""
    refusal = result.message.get("refusal")
    return refusal if isinstance(refusal, str) and refusal else None


def output_items(
    result: RunResult,
    prefix: str,
    names: ToolNames,
    server_calls: list[dict[str, Any]],
    max_output_tokens: int | None,
) -> list[dict[str, Any]]:
    """The `output` of a run that did not fail, in order: its server calls, its client calls,
    and its final message when it has text (SPEC §12.2), `incomplete` when cut at the client's
    `max_output_tokens`; then a message with the model's refusal, when it refused."""
    items = [*server_calls, *client_items(result, prefix, names)]
    text = result.message.get("content")
    if isinstance(text, str) and text:
        status = "incomplete" if cut_short(result, max_output_tokens) else "completed"
        items.append(message_item(f"msg_{prefix}", text, status))
    if (refusal := refusal_of(result)) is not None:
        items.append(refusal_item(f"msg_{prefix}" + ("_refusal" if len(items) else ""), refusal))
    return items
