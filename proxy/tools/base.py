"""A server tool: its definition for the model and how to invoke it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticSerializationError, to_jsonable_python

from proxy import exact_json
from proxy.engine.values import ToolContext, ToolSpec

Invoke = Callable[[dict[str, Any], ToolContext], Awaitable[Any]]

# How long the pools of http tools, webhooks and MCP servers keep an idle connection: less than
# the 2 s after which gunicorn's threaded and async workers close one, and the 5 s of uvicorn
# (FastMCP's server too) and Node. As long as the server's, a call could go out on a connection
# the server was closing and fail unanswered; a tool call is not sent again, as an upstream
# request is (it may act on the world). Calls closer together than this share connections.
TOOL_KEEPALIVE_S = 1.5


class ToolFailed(Exception):
    """A tool failure whose message the model may read."""


class BadArguments(ToolFailed):
    pass


def output_too_large(cap: int) -> ToolFailed:
    return ToolFailed(
        f"the tool's output is larger than {cap} bytes (its max_output_bytes); "
        "it was discarded, none of it is given"
    )


@dataclass(frozen=True, slots=True)
class Tool:
    spec: ToolSpec
    invoke: Invoke
    timeout_s: float
    # Validates parsed arguments, returning them (possibly coerced); raises BadArguments.
    validate: Callable[[dict[str, Any]], dict[str, Any]]
    max_output_bytes: int = 1024 * 1024  # of the text the model reads; more is a tool error
    grace_s: float = 0.0  # past `timeout_s`, for a transport's own timeout to come first

    @property
    def name(self) -> str:
        return self.spec.name


def definition(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def as_text(value: Any) -> str:
    """A tool's output as the text the model reads: strings as they are, anything else as JSON
    (pydantic models, dataclasses and dates as pydantic writes them, keys that are no strings
    as text, integers of any size). ToolFailed when it is no JSON (a value that contains
    itself)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    try:
        return exact_json.dumps(value, _jsonable).decode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise ToolFailed(f"the tool's result is no JSON value: {exc}") from None


def _jsonable(value: Any) -> Any:
    try:
        return to_jsonable_python(value)
    except PydanticSerializationError:
        return str(value)
