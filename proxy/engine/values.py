"""The values that cross the engine's boundary: model calls and replies, tool calls and results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import orjson

from proxy.engine.usage import Usage

# The blank line between the texts of a run's steps in its reply (SPEC §4.3).
PART_BREAK = "\n\n"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model produced it

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ModelRequest:
    """One upstream call. `params` are the client's other Chat Completions fields."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: Any = None
    max_completion_tokens: int | None = None
    stream: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    step: int = 0


@dataclass(slots=True)
class ModelReply:
    message: dict[str, Any]  # the assistant message, OpenAI shape
    tool_calls: list[ToolCall]
    finish_reason: str | None
    usage: Usage
    reported_cost_usd: float | None = None
    response_id: str | None = None
    response_model: str | None = None
    # The upstream body (JSON mode) for relaying fields the proxy does not own.
    raw: dict[str, Any] | None = None
    first_chunk_s: float | None = None  # streaming: time from the request to the first chunk

    @property
    def text(self) -> str:
        content = self.message.get("content")
        return content if isinstance(content, str) else ""


class DeltaSink(Protocol):
    """Where a streamed answer goes as it is read."""

    async def begin(self, head: Mapping[str, str], text: str) -> None:
        """Its first sound read: `head`, the fields the upstream's chunks carry beside their
        deltas (`model`, `system_fingerprint`, `service_tier`, those it sent as short
        strings), and that read's text ("" when it held none)."""
        ...

    async def __call__(self, text: str) -> None:
        """A later read's text."""
        ...


class ToolOutcome(StrEnum):
    """How a server tool's call ended (SPEC §11.2: the `outcome` of
    `loopwarden_tool_calls_total`, the span's `loopwarden.tool.outcome`): it ran (`ok`, `error`,
    `timeout`), or a rule or a limit kept it from running."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    BLOCKED_RULE = "blocked_rule"
    BLOCKED_LIMIT = "blocked_limit"


@dataclass(frozen=True, slots=True)
class ToolResult:
    output: str
    outcome: ToolOutcome = ToolOutcome.OK

    @property
    def is_error(self) -> bool:
        return self.outcome != ToolOutcome.OK


@dataclass(frozen=True, slots=True)
class ToolContext:
    run_id: str
    thread_id: str | None
    step: int
    call_id: str = ""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A server tool as the engine sees it."""

    name: str
    definition: dict[str, Any]  # OpenAI `tools[]` entry
    terminal: bool = False
    id: str | None = None
    # The `tools:` entry of the MCP server the tool comes from (SPEC §13); None for the others.
    source: str | None = None


@dataclass(frozen=True, slots=True)
class Prices:
    """USD per token."""

    input: float
    output: float


# The most tool names a message for the model lists (an MCP source may expose 4,096: listed in
# full, 128 calls of unknown tools a reply made megabytes of messages).
MAX_LISTED_NAMES = 32


def listed_names(names: Sequence[str]) -> str:
    """`names` for a message to the model: at most MAX_LISTED_NAMES, then how many more."""
    shown = ", ".join(names[:MAX_LISTED_NAMES])
    more = len(names) - MAX_LISTED_NAMES
    return f"{shown} and {more} more" if more > 0 else shown


def error_content(message: str) -> str:
    """A tool message's content for a call that failed or did not run: `{"error": message}`."""
    return orjson.dumps({"error": message}).decode()


def tool_content(result: ToolResult) -> str:
    """The content of the tool message that gives the model `result`."""
    return error_content(result.output) if result.is_error else result.output
