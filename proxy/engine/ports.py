"""What the engine needs from the world, as Protocols; adapters below implement them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from proxy.engine.events import RunEvent
from proxy.engine.usage import Usage


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


DeltaSink = Callable[[str], Awaitable[None]]


class ChatModel(Protocol):
    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None) -> ModelReply:
        """Call the model; stream content deltas to `on_delta` when given."""
        ...


Outcome = Literal["ok", "error", "timeout"]


@dataclass(frozen=True, slots=True)
class ToolResult:
    output: str
    outcome: Outcome = "ok"

    @property
    def is_error(self) -> bool:
        return self.outcome != "ok"


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


class ToolExecutor(Protocol):
    async def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        """Run a server tool; never raises for tool failures (they are `ToolResult`s)."""
        ...


@dataclass(frozen=True, slots=True)
class Prices:
    """USD per token."""

    input: float
    output: float


class PriceBook(Protocol):
    def prices(self, model: str) -> Prices | None: ...

    def cost(self, model: str, usage: Usage) -> float | None: ...


class ConditionChecks(Protocol):
    """Custom stop conditions that live outside the engine (`webhook`, `python`)."""

    async def check(self, kind: str, name: str, snapshot: Mapping[str, Any]) -> bool: ...


class ThreadCounters(Protocol):
    """Thread-scoped call counters in the state backend (SPEC §9), exact across replicas."""

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int]
    ) -> tuple[bool, dict[str, int]]:
        """Atomically: when every counter is below its limit, add one to each.

        Returns whether it did, and the counters after (or as they are, when it did not).
        """
        ...


class RunObserver(Protocol):
    def on_event(self, event: RunEvent) -> None: ...


class RunStream(Protocol):
    """Where a streaming run sends what the client sees while it runs."""

    async def content(self, text: str) -> None: ...

    async def loop_event(self, event: dict[str, Any]) -> None: ...
