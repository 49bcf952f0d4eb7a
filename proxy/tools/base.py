"""A server tool: its definition for the model and how to invoke it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.engine.values import ToolContext, ToolSpec

Invoke = Callable[[dict[str, Any], ToolContext], Awaitable[Any]]


class ToolFailed(Exception):
    """A tool failure whose message the model may read."""


class BadArguments(ToolFailed):
    pass


@dataclass(frozen=True, slots=True)
class Tool:
    spec: ToolSpec
    invoke: Invoke
    timeout_s: float
    # Validates parsed arguments, returning them (possibly coerced); raises BadArguments.
    validate: Callable[[dict[str, Any]], dict[str, Any]]

    @property
    def name(self) -> str:
        return self.spec.name


def definition(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "parameters": parameters}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def as_text(value: Any) -> str:
    """A tool's output as the text the model reads: strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return orjson.dumps(value, default=str).decode()
