"""A Chat Completions body and its `loop` object, validated with JSON paths (SPEC §4.1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.engine.fields import boolean, int_at_least, text
from proxy.engine.policies.stop_conditions import Condition, parse_stop_when
from proxy.engine.policies.terminal import TerminatingConfig, parse_terminating_config
from proxy.engine.policies.tool_call_limits import ToolCallLimit, parse_tool_call_limits
from proxy.engine.policies.tool_rules import ToolRule, parse_tool_rules
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
LOOP_FIELDS = (
    "agent",
    "tools",
    "stop_when",
    "terminating_config",
    "tool_rules",
    "tool_call_limits",
    "max_steps",
    "final_answer",
    "thread_id",
    "parallel_tool_calls",
    "include_messages",
    "include_loop_events",
)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(slots=True)
class LoopOptions:
    agent: str | None = None
    tools: list[str] = field(default_factory=list)
    stop_when: list[Condition] = field(default_factory=list)
    terminating: TerminatingConfig | None = None
    tool_rules: tuple[ToolRule, ...] = ()
    tool_call_limits: tuple[ToolCallLimit, ...] = ()
    max_steps: int | None = None
    final_answer: bool | None = None
    thread_id: str | None = None
    parallel_tool_calls: bool | None = None
    include_messages: bool = False
    include_loop_events: bool = False


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    tools: list[dict[str, Any]]
    tool_choice: Any
    max_completion_tokens: int | None
    params: dict[str, Any]
    loop: LoopOptions
    has_loop: bool


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def parse_chat_request(raw: bytes) -> ChatRequest:
    body = json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required and must be a string", param="model")
    messages = _messages(body.get("messages"))
    stream = boolean(body.get("stream", False), "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("must be an object", param="stream_options")
        include_usage = boolean(options.get("include_usage", False), "stream_options.include_usage")
    tools = _tools(body.get("tools"))
    cap = body.get("max_completion_tokens")
    if cap is not None:
        cap = int_at_least(cap, "max_completion_tokens")
    if body.get("max_tokens") is not None:
        int_at_least(body["max_tokens"], "max_tokens")
    n = body.get("n")
    if n is not None:
        int_at_least(n, "n")
    params = {k: v for k, v in body.items() if k not in OWN_FIELDS}
    has_loop = body.get("loop") is not None
    loop = parse_loop(body["loop"]) if has_loop else LoopOptions()
    return ChatRequest(
        model,
        messages,
        stream,
        include_usage,
        tools,
        body.get("tool_choice"),
        cap,
        params,
        loop,
        has_loop,
    )


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


def parse_loop(value: Any) -> LoopOptions:
    if not isinstance(value, dict):
        raise InvalidRequest("loop must be an object", param="loop")
    for key in value:
        if key not in LOOP_FIELDS:
            raise InvalidRequest(
                f"unknown loop field; expected one of {', '.join(LOOP_FIELDS)}", param=f"loop.{key}"
            )
    out = LoopOptions()
    if value.get("agent") is not None:
        out.agent = text(value["agent"], "loop.agent")
    tools = value.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("must be a list of tool names", param="loop.tools")
        out.tools = [text(t, f"loop.tools[{i}]") for i, t in enumerate(tools)]
    if value.get("stop_when") is not None:
        out.stop_when = parse_stop_when(value["stop_when"], "loop.stop_when")
    if value.get("terminating_config") is not None:
        out.terminating = parse_terminating_config(
            value["terminating_config"], "loop.terminating_config"
        )
    if value.get("tool_rules") is not None:
        out.tool_rules = parse_tool_rules(value["tool_rules"], "loop.tool_rules")
    if value.get("tool_call_limits") is not None:
        out.tool_call_limits = parse_tool_call_limits(
            value["tool_call_limits"], "loop.tool_call_limits"
        )
    if value.get("max_steps") is not None:
        out.max_steps = int_at_least(value["max_steps"], "loop.max_steps")
    if value.get("final_answer") is not None:
        out.final_answer = boolean(value["final_answer"], "loop.final_answer")
    if value.get("thread_id") is not None:
        out.thread_id = text(value["thread_id"], "loop.thread_id")
    if value.get("parallel_tool_calls") is not None:
        out.parallel_tool_calls = boolean(value["parallel_tool_calls"], "loop.parallel_tool_calls")
    out.include_messages = boolean(value.get("include_messages", False), "loop.include_messages")
    out.include_loop_events = boolean(
        value.get("include_loop_events", False), "loop.include_loop_events"
    )
    return out
