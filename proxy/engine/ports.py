"""What the engine needs from the world, as Protocols; adapters below implement them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from proxy.engine.events import RunEvent
from proxy.engine.usage import Usage
from proxy.engine.values import (
    DeltaSink,
    ModelReply,
    ModelRequest,
    Prices,
    ToolCall,
    ToolContext,
    ToolResult,
)


class ChatModel(Protocol):
    """The upstream model: one call a step, its retries inside."""

    async def complete(
        self, request: ModelRequest, on_delta: DeltaSink | None, *, deadline: float | None = None
    ) -> ModelReply:
        """Call the model; stream content deltas to `on_delta` when given. `deadline` (a
        `time.monotonic()` instant) is when the call must give up, if not before: it then
        raises `proxy.errors.CallDeadlineReached` (an UpstreamTimeout)."""
        ...


class ToolExecutor(Protocol):
    """The server's tools (http, python, builtin, MCP), by name."""

    async def check(self, call: ToolCall) -> dict[str, Any] | str:
        """The arguments of `call` as its tool takes them, or why it would fail at once:
        asked before a limit counts it."""
        ...

    async def execute(
        self, call: ToolCall, ctx: ToolContext, arguments: dict[str, Any] | None = None
    ) -> ToolResult:
        """Run a server tool; never raises for tool failures (they are `ToolResult`s).
        `arguments`: what `check` gave for the call, not checked again."""
        ...


class PriceBook(Protocol):
    """What a model's tokens cost (the config's prices, else `genai-prices`)."""

    def prices(self, model: str) -> Prices | None:
        """The model's prices a token; None when none are known."""
        ...

    def cost(self, model: str, usage: Usage) -> float | None:
        """What `usage` of the model cost in USD; None when its prices are not known."""
        ...


class ConditionChecks(Protocol):
    """Custom stop conditions that live outside the engine (`webhook`, `python`)."""

    async def check(self, kind: str, name: str, snapshot: Mapping[str, Any]) -> bool | None:
        """Whether the condition holds; None: it could not be evaluated (it failed)."""
        ...


class ThreadCounters(Protocol):
    """Thread-scoped call counters in the state backend (SPEC §9), exact across replicas."""

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int]
    ) -> tuple[bool, dict[str, int]]:
        """Atomically: when every counter is below its limit, add one to each.

        Returns whether it did, and the counters after (or as they are, when it did not).
        """
        ...

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        """The counters as they are."""
        ...

    async def release(self, thread_id: str, counts: Mapping[str, int]) -> None:
        """Takes `counts` from the counters, none below 0: what `reserve` took for calls that
        never ran (SPEC §9: only executed calls count)."""
        ...


class RunObserver(Protocol):
    """Telemetry and other listeners of a run: told each event as it happens, they never
    change the run (one that raises is logged and ignored)."""

    def on_event(self, event: RunEvent) -> None:
        """One event of a run, in order; called on the run's task, so it must not block."""
        ...


class RunStream(Protocol):
    """Where a streaming run sends what the client sees while it runs."""

    def heard(self, head: Mapping[str, str]) -> None:
        """A step's streamed answer has begun with `head`, the fields the upstream's chunks
        carry beside their deltas (DeltaSink.begin); told before `begin` or its text."""
        ...

    async def begin(self) -> None:
        """A streamed answer has begun to arrive: the client's response may start now."""
        ...

    async def content(self, text: str) -> None:
        """Text the client sees next: a step's delta, or the run's own (a terminal tool's
        output, the blank line between steps' texts)."""
        ...

    async def progress(self, event: RunEvent) -> None:
        """Every run event, in order; a stream shows the progress it cares about."""
        ...
