"""A Responses API body (SPEC §12.1), validated with JSON paths, as an endpoint-neutral run.

The input items are checked by `proxy.api.response_input`; they become messages once the stored
items they refer to (`previous_response_id`, `item_reference`) are read (`proxy.api.responses`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.api.body_fields import (
    boolean,
    name,
    number,
    object_field,
    optional,
    positive_int,
    string,
)
from proxy.api.chat_request import MAX_CLIENT_TOOLS
from proxy.api.json_body import json_object
from proxy.api.response_input import checked_input
from proxy.api.response_items import CUSTOM_PARAMETERS, ClientTool, upstream_name
from proxy.api.run_request import NO_LOOP, LoopOptions, RunRequest, parse_loop, thread_of
from proxy.engine.options import ToolCallLimitOptions
from proxy.errors import InvalidRequest

TOOL_CHOICES = frozenset({"auto", "none", "required"})
FORMAT_TYPES = frozenset({"text", "json_schema", "json_object"})
VERBOSITIES = ("low", "medium", "high")
# Fields passed upstream under the same name when given.
SAME_NAMED = ("temperature", "top_p", "user", "prompt_cache_key", "safety_identifier")
UNSUPPORTED = {
    "background": "background responses are not supported: leave background unset or false",
    "conversation": "conversations are not supported: use previous_response_id or send input",
    "prompt": "prompt templates are not supported: send instructions and input",
}


@dataclass(slots=True)
class ResponsesRequest:
    run: RunRequest  # `messages` are set once the stored items are read
    stream: bool
    store: bool
    items: list[dict[str, Any]]
    previous_response_id: str | None = None
    instructions: str | None = None
    names: dict[str, ClientTool] = field(default_factory=dict)
    ignored_tools: list[str] = field(default_factory=list)
    max_output_tokens: int | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # settings the response repeats


def parse_responses_request(raw: bytes, thread_header: str | None = None) -> ResponsesRequest:
    body = json_object(raw)
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False):
            raise InvalidRequest(why, param=key, code="unsupported_parameter")
    model = name(body.get("model"), "model")
    previous = body.get("previous_response_id")
    if previous is not None:
        previous = name(previous, "previous_response_id")
    items = checked_input(body.get("input"), previous is not None)
    instructions = optional(body, "instructions", str, "a string")
    stream = optional(body, "stream", bool, "a boolean") or False
    store = optional(body, "store", bool, "a boolean")
    store = True if store is None else store
    tools, names, ignored, tool_params = _tools(body.get("tools"))
    params = _params(body)
    max_output_tokens = positive_int(body.get("max_output_tokens"), "max_output_tokens")
    max_tool_calls = positive_int(body.get("max_tool_calls"), "max_tool_calls")
    has_loop = body.get("loop") is not None
    loop = parse_loop(body["loop"]) if has_loop else NO_LOOP
    if max_tool_calls is not None:
        loop = _with_call_limit(loop, max_tool_calls)
        has_loop = True
    thread = thread_of(loop, thread_header)
    run = RunRequest(
        model,
        [],
        loop,
        has_loop,
        tools,
        _tool_choice(body.get("tool_choice")),
        max_output_tokens,
        params,
        thread,
        client_thread=True,
        tool_params=tool_params,
        choice_param="tool_choice.name",
    )
    echo = {
        "instructions": instructions,
        "tools": _echoed_tools(body.get("tools") or []),
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "metadata": body.get("metadata") or {},
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": max_tool_calls,
        "previous_response_id": previous,
        "store": store,
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
        "background": False,
    }
    return ResponsesRequest(
        run,
        stream,
        store,
        items,
        previous,
        instructions,
        names,
        ignored,
        max_output_tokens,
        echo,
    )


# -- fields with an upstream meaning --------------------------------------------------------


def _params(body: dict[str, Any]) -> dict[str, Any]:
    """The Chat Completions fields the Responses fields map to (SPEC §12.1)."""
    params: dict[str, Any] = {}
    for key in SAME_NAMED:
        value = body.get(key)
        if value is None:
            continue
        if key in ("temperature", "top_p"):
            number(value, key)
        else:
            string(value, key)
        params[key] = value
    if body.get("parallel_tool_calls") is not None:
        params["parallel_tool_calls"] = optional(body, "parallel_tool_calls", bool, "a boolean")
    if body.get("service_tier") is not None:
        params["service_tier"] = string(body["service_tier"], "service_tier")
    if body.get("metadata") is not None:
        metadata = object_field(body["metadata"], "metadata")
        if len(metadata) > MAX_METADATA_PAIRS:
            raise InvalidRequest(f"has more than {MAX_METADATA_PAIRS} pairs", param="metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise InvalidRequest(
                    f"a key is longer than {MAX_METADATA_KEY_CHARS} characters", param="metadata"
                )
            string(value, f"metadata.{key}")
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise InvalidRequest(
                    f"longer than {MAX_METADATA_VALUE_CHARS} characters", param=f"metadata.{key}"
                )
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise InvalidRequest("must be a list", param="include")
        for i, item in enumerate(include):
            string(item, f"include[{i}]")
    for key in ("truncation",):
        if body.get(key) is not None:
            string(body[key], key)
    for key in ("client_metadata", "stream_options"):
        if body.get(key) is not None:
            object_field(body[key], key)
    text = body.get("text")
    if text is not None:
        text = object_field(text, "text")
        if text.get("format") is not None:
            response_format = _format(object_field(text["format"], "text.format"))
            if response_format is not None:
                params["response_format"] = response_format
        if text.get("verbosity") is not None:
            verbosity = string(text["verbosity"], "text.verbosity")
            if verbosity not in VERBOSITIES:
                raise InvalidRequest(
                    f"must be one of {', '.join(VERBOSITIES)}", param="text.verbosity"
                )
            params["verbosity"] = verbosity
    reasoning = body.get("reasoning")
    if reasoning is not None:
        reasoning = object_field(reasoning, "reasoning")
        if reasoning.get("effort") is not None:
            params["reasoning_effort"] = string(reasoning["effort"], "reasoning.effort")
        if reasoning.get("summary") is not None:
            string(reasoning["summary"], "reasoning.summary")
    return params


# OpenAI's bounds of `metadata`, kept with every stored response.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# What a hosted tool carries that is a secret: OpenAI keeps none of it (a client sends it again
# with every request), so a response neither echoes nor stores it.
HOSTED_SECRETS = ("authorization", "headers")


def _echoed_tools(tools: Any) -> Any:
    """The request's tools as its response echoes them, hosted tools' secrets left out."""
    if not isinstance(tools, list):
        return tools
    return [
        {k: v for k, v in tool.items() if k not in HOSTED_SECRETS}
        if isinstance(tool, dict) and tool.get("type") == "mcp"
        else tool
        for tool in tools
    ]


def _format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if not isinstance(kind, str) or kind not in FORMAT_TYPES:
        raise InvalidRequest(
            f"type must be one of {', '.join(sorted(FORMAT_TYPES))}", param="text.format.type"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    schema: dict[str, Any] = {"name": name(fmt.get("name"), "text.format.name")}
    if fmt.get("schema") is not None:
        schema["schema"] = object_field(fmt["schema"], "text.format.schema")
    if fmt.get("strict") is not None:
        schema["strict"] = boolean(fmt["strict"], "text.format.strict")
    if fmt.get("description") is not None:
        schema["description"] = string(fmt["description"], "text.format.description")
    return {"type": "json_schema", "json_schema": schema}


def _with_call_limit(loop: LoopOptions, count: int) -> LoopOptions:
    """`max_tool_calls`: a run limit over all server tool calls that goes on (SPEC §12.1)."""
    limit = ToolCallLimitOptions(run_limit=count, exit_behavior="continue")
    return loop.model_copy(update={"tool_call_limits": [*loop.tool_call_limits, limit]})


# -- tools ----------------------------------------------------------------------------------


def _tools(
    value: Any,
) -> tuple[list[dict[str, Any]], dict[str, ClientTool], list[str], list[str]]:
    """Client tools as upstream functions, the client's names of those renamed or custom, the
    hosted tool types left out, and where each function's name is in the request."""
    if value is None:
        return [], {}, [], []
    if not isinstance(value, list):
        raise InvalidRequest("tools must be a list", param="tools")
    if len(value) > MAX_CLIENT_TOOLS:
        raise InvalidRequest(f"more than {MAX_CLIENT_TOOLS} tools", param="tools")
    functions: list[dict[str, Any]] = []
    names: dict[str, ClientTool] = {}
    ignored: list[str] = []
    params: list[str] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        path = f"tools[{i}]"
        tool = object_field(tool, path)
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise InvalidRequest("type must be a string", param=f"{path}.type")
        if kind == "namespace":
            namespace = name(tool.get("name"), f"{path}.name")
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise InvalidRequest("tools must be a list", param=f"{path}.tools")
            if len(functions) + len(inner) > MAX_CLIENT_TOOLS:
                raise InvalidRequest(f"more than {MAX_CLIENT_TOOLS} tools", param="tools")
            for j, member in enumerate(inner):
                where = f"{path}.tools[{j}]"
                member = object_field(member, where)
                if member.get("type") not in ("function", "custom"):
                    raise InvalidRequest(
                        "a namespace holds function and custom tools", param=f"{where}.type"
                    )
                _add(functions, names, seen, member, where, namespace)
                params.append(f"{where}.name")
        elif kind in ("function", "custom"):
            _add(functions, names, seen, tool, path, None)
            params.append(f"{path}.name")
        else:  # a hosted tool the proxy cannot run
            ignored.append(kind)
    return functions, names, ignored, params


def _add(
    functions: list[dict[str, Any]],
    names: dict[str, ClientTool],
    seen: set[str],
    tool: dict[str, Any],
    path: str,
    namespace: str | None,
) -> None:
    kind = tool["type"]
    own = name(tool.get("name"), f"{path}.name")
    flat = upstream_name(own, namespace)
    if flat in seen:
        raise InvalidRequest(f"duplicate tool {own!r}", param=f"{path}.name")
    seen.add(flat)
    function: dict[str, Any] = {"name": flat}
    description = tool.get("description")
    if description is not None:
        function["description"] = string(description, f"{path}.description")
    if kind == "custom":
        fmt = tool.get("format")
        if isinstance(fmt, dict) and isinstance(fmt.get("definition"), str):
            syntax = fmt.get("syntax", "grammar")
            rule = f"The input follows this {syntax}:\n{fmt['definition']}"
            function["description"] = f"{description}\n\n{rule}" if description else rule
        function["parameters"] = CUSTOM_PARAMETERS
        names[flat] = ClientTool("custom", own, namespace)
    else:
        parameters = tool.get("parameters")
        function["parameters"] = (
            object_field(parameters, f"{path}.parameters")
            if parameters is not None
            else {"type": "object", "properties": {}}
        )
        if tool.get("strict") is not None:
            function["strict"] = boolean(tool["strict"], f"{path}.strict")
        if namespace:
            names[flat] = ClientTool("function", own, namespace)
    functions.append({"type": "function", "function": function})


def _tool_choice(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise InvalidRequest(
                f"tool_choice must be one of {', '.join(sorted(TOOL_CHOICES))} or an object",
                param="tool_choice",
            )
        return value
    choice = object_field(value, "tool_choice")
    kind = choice.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest("type must be a string", param="tool_choice.type")
    if kind in ("function", "custom"):
        return {"type": "function", "function": {"name": _chosen(choice, "tool_choice")}}
    if kind == "allowed_tools":
        return _allowed_tools(choice)
    return "auto"  # a hosted tool's choice: hosted tools are not offered


def _chosen(tool: dict[str, Any], path: str) -> str:
    """The flat name of the function or custom tool `tool` names (with its namespace)."""
    own = name(tool.get("name"), f"{path}.name")
    namespace = tool.get("namespace")
    if namespace is not None:
        string(namespace, f"{path}.namespace")
    return upstream_name(own, namespace)


def _allowed_tools(choice: dict[str, Any]) -> Any:
    """Chat Completions' `allowed_tools` of the tools the choice lists: the model may call
    those alone, of all the tools offered (hosted tools are not offered: left out; a list of
    hosted tools alone, the proxy's own `mcp` label among them, is its mode)."""
    mode = string(choice.get("mode", "auto"), "tool_choice.mode")
    if mode not in ("auto", "required"):
        raise InvalidRequest("must be auto or required", param="tool_choice.mode")
    listed = choice.get("tools")
    if not isinstance(listed, list):
        raise InvalidRequest("must be a list of tools", param="tool_choice.tools")
    tools = []
    for i, tool in enumerate(listed):
        path = f"tool_choice.tools[{i}]"
        kind = object_field(tool, path).get("type")
        if kind in ("function", "custom"):
            tools.append({"type": "function", "function": {"name": _chosen(tool, path)}})
    if not tools:
        return mode
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}
