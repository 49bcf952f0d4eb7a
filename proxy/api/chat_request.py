"""A Chat Completions body, validated with JSON paths (SPEC §4.1), as a run request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.api.run_request import NO_LOOP, RunRequest, parse_loop
from proxy.errors import InvalidRequest

# Body fields the proxy owns; every other field goes upstream as the client sent it.
OWN_FIELDS = frozenset(
    {
        "model",
        "messages",
        "tools",
        "tool_choice",
        "stream",
        "stream_options",
        "loop",
        "max_completion_tokens",
    }
)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(slots=True)
class ChatRequest:
    run: RunRequest
    stream: bool
    include_usage: bool


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def parse_chat_request(raw: bytes, thread_header: str | None = None) -> ChatRequest:
    body = json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required and must be a string", param="model")
    messages = _messages(body.get("messages"))
    stream = _boolean(body.get("stream", False), "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("must be an object", param="stream_options")
        include_usage = _boolean(
            options.get("include_usage", False), "stream_options.include_usage"
        )
    tools = _tools(body.get("tools"))
    cap = _positive(body.get("max_completion_tokens"), "max_completion_tokens")
    _positive(body.get("max_tokens"), "max_tokens")
    _positive(body.get("n"), "n")
    params = {k: v for k, v in body.items() if k not in OWN_FIELDS}
    has_loop = body.get("loop") is not None
    loop = parse_loop(body["loop"]) if has_loop else NO_LOOP
    run = RunRequest(
        model,
        messages,
        loop,
        has_loop,
        tools,
        body.get("tool_choice"),
        cap,
        params,
        loop.thread_id or thread_header,
        client_thread=True,
    )
    return ChatRequest(run, stream, include_usage)


def _boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest("must be a boolean", param=param)
    return value


def _positive(value: Any, param: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest("must be a positive integer", param=param)
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidRequest("each message must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"role must be one of {', '.join(sorted(ROLES))}", param=f"messages[{i}].role"
            )
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise InvalidRequest(
                "a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id"
            )
    return value


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest("tools must be a list", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidRequest("each tool must be a function tool", param=f"tools[{i}]")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest("function must be an object", param=f"tools[{i}].function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("name must be a string", param=f"tools[{i}].function.name")
        if name in names:
            raise InvalidRequest(f"duplicate tool {name!r}", param=f"tools[{i}].function.name")
        names.add(name)
    return value
