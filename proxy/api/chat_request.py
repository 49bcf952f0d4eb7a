"""A Chat Completions body, validated with JSON paths (SPEC §4.1), as a run request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.api.body_fields import boolean, name, positive_int
from proxy.api.chat_params import check_params
from proxy.api.json_body import json_object
from proxy.api.run_request import NO_LOOP, RunRequest, parse_loop, thread_of
from proxy.engine.options import MAX_NAME_CHARS
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
# The most client tools a request may offer (OpenAI takes 128 functions).
MAX_CLIENT_TOOLS = 512
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(slots=True)
class ChatRequest:
    run: RunRequest
    stream: bool
    include_usage: bool


def parse_chat_request(raw: bytes, thread_header: str | None = None) -> ChatRequest:
    body = json_object(raw)
    model = name(body.get("model"), "model")
    messages = _messages(body.get("messages"))
    stream = boolean(body.get("stream", False), "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("must be an object", param="stream_options")
        include_usage = boolean(options.get("include_usage", False), "stream_options.include_usage")
    tools = _tools(body.get("tools"))
    cap = positive_int(body.get("max_completion_tokens"), "max_completion_tokens")
    legacy = positive_int(body.get("max_tokens"), "max_tokens")
    newer = cap is not None
    if legacy is not None and (cap is None or legacy < cap):  # one cap: the lower
        cap = legacy
    if (positive_int(body.get("n"), "n") or 1) > 1 and stream:
        raise InvalidRequest("n must be 1 for a stream: the proxy streams one answer", param="n")
    if body.get("logprobs") and stream:  # (they were dropped: every chunk's were null)
        raise InvalidRequest(
            "a stream's chunks carry no logprobs through the proxy: ask for them without stream",
            param="logprobs",
            code="unsupported_parameter",
        )
    check_params(body)
    params = {k: v for k, v in body.items() if k not in OWN_FIELDS}
    if newer or legacy is None:  # the cap goes in the newer field when it was sent (OpenAI
        params.pop("max_tokens", None)  # refuses the two at once), or a null `max_tokens`
    has_loop = body.get("loop") is not None
    loop = parse_loop(body["loop"]) if has_loop else NO_LOOP
    run = RunRequest(
        model,
        messages,
        loop,
        has_loop,
        tools,
        _tool_choice(body.get("tool_choice")),
        cap,
        params,
        thread_of(loop, thread_header),
        client_thread=True,
    )
    return ChatRequest(run, stream, include_usage)


def _tool_choice(value: Any) -> Any:
    """What the first step asks the model for: a string (`none`, `auto`, `required`, or a
    provider's own, as Mistral's `any`), or an object of a `type` (naming its tool for
    `function` and `custom`), sent on as it is."""
    if value is None or (isinstance(value, str) and value):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest(
            "tool_choice must be a string (none, auto, required) or an object with a type",
            param="tool_choice",
        )
    named = value.get(value["type"])
    if value["type"] in ("function", "custom") and not (
        isinstance(named, dict) and isinstance(named.get("name"), str)
    ):
        kind = value["type"]
        raise InvalidRequest(f"must name the {kind} tool", param=f"tool_choice.{kind}.name")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    for i, message in enumerate(value):
        _message(message, f"messages[{i}]")
    return value


def _message(message: Any, path: str) -> None:
    """Checks the parts of a message that the proxy reads; the rest goes upstream as it is."""
    if not isinstance(message, dict):
        raise InvalidRequest("each message must be an object", param=path)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest(
            f"role must be one of {', '.join(sorted(ROLES))}", param=f"{path}.role"
        )
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise InvalidRequest("content must be a string or a list of parts", param=f"{path}.content")
    for k, part in enumerate(content if isinstance(content, list) else ()):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequest(
                "each part must be an object with a type", param=f"{path}.content[{k}]"
            )
    if role == "tool":
        name(message.get("tool_call_id"), f"{path}.tool_call_id")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if role != "assistant" or not isinstance(calls, list):
        raise InvalidRequest(
            "tool_calls must be a list on an assistant message", param=f"{path}.tool_calls"
        )
    for j, call in enumerate(calls):
        where = f"{path}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(call.get("id"), str):
            raise InvalidRequest("a tool call needs an id and a function", param=where)
        name(call["id"], f"{where}.id")  # (as the Responses API's `call_id`)
        if not isinstance(function.get("name"), str):
            raise InvalidRequest("must be a string", param=f"{where}.function.name")
        name(function["name"], f"{where}.function.name")
        if not isinstance(function.get("arguments"), str):
            raise InvalidRequest("must be a string", param=f"{where}.function.arguments")


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest("tools must be a list", param="tools")
    if len(value) > MAX_CLIENT_TOOLS:
        raise InvalidRequest(f"more than {MAX_CLIENT_TOOLS} tools", param="tools")
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
        if len(name) > MAX_NAME_CHARS:  # as the Responses API's: no model API takes more
            raise InvalidRequest(
                f"tools[{i}].function.name is longer than {MAX_NAME_CHARS} characters",
                param=f"tools[{i}].function.name",
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidRequest(
                "parameters must be a JSON schema object", param=f"tools[{i}].function.parameters"
            )
        if name in names:
            raise InvalidRequest(f"duplicate tool {name!r}", param=f"tools[{i}].function.name")
        names.add(name)
    return value
