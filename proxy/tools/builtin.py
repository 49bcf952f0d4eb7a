"""Tools shipped with the proxy (SPEC §2)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.engine.values import ToolContext


@dataclass(frozen=True, slots=True)
class Builtin:
    description: str
    parameters: dict[str, Any]
    terminal: bool
    run: Callable[[dict[str, Any]], str]


def _string_param(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": description}},
        "required": [name],
        "additionalProperties": False,
    }


BUILTINS: dict[str, Builtin] = {
    "final_answer": Builtin(
        "Give your final answer to the user. Calling this ends your turn.",
        _string_param("answer", "The complete answer for the user."),
        True,
        lambda args: str(args["answer"]),
    ),
    "complete_task": Builtin(
        "Report that the task is complete. Calling this ends your turn.",
        _string_param("result", "What was done."),
        True,
        lambda args: f"Task completed: {args['result']}",
    ),
}


def builtin_invoke(builtin: Builtin) -> Callable[[dict[str, Any], ToolContext], Any]:
    async def invoke(arguments: dict[str, Any], ctx: ToolContext) -> str:
        return builtin.run(arguments)

    return invoke
