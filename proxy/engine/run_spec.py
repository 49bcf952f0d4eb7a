"""What a run is given (its spec and its collaborators) and what it gives back."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.final_message import Ending
from proxy.engine.policy import LoopPolicy
from proxy.engine.ports import (
    ChatModel,
    ConditionChecks,
    PriceBook,
    RunObserver,
    ThreadCounters,
    ToolExecutor,
)
from proxy.engine.state import RunState
from proxy.engine.stop import Stop
from proxy.engine.usage import Usage
from proxy.engine.values import ModelReply, ModelRequest


@dataclass(slots=True)
class RunSpec:
    """Everything one run needs that the client or the config decided."""

    run_id: str
    model: str  # the upstream model name
    messages: list[dict[str, Any]]
    policy: LoopPolicy
    agent: str | None = None
    system_prompt: str | None = None
    client_tools: list[dict[str, Any]] = field(default_factory=list)
    client_tool_choice: Any = None
    max_completion_tokens: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    thread_id: str | None = None
    # What the run's tool calls may give the model together (None: no bound).
    max_tool_output: int | None = None

    @property
    def one_document(self) -> bool:
        """The client asked for a JSON reply (`response_format` of type `json_schema` or
        `json_object`) of a run that may take more than one step: its reply's text is the last
        step's alone (one JSON document, what a client parses), and a stream sends it whole as
        the run ends (SPEC §5.3)."""
        form = self.params.get("response_format")
        return (
            isinstance(form, dict)
            and form.get("type") in ("json_schema", "json_object")
            and self.policy.may_take_steps
        )


@dataclass(slots=True)
class Deps:
    model: ChatModel
    tools: ToolExecutor
    prices: PriceBook
    observers: Sequence[RunObserver] = ()
    checks: ConditionChecks | None = None
    clock: Callable[[], float] = time.monotonic
    threads: ThreadCounters | None = None
    # How long a run's keep under way is waited for once the run is cancelled (None: to its
    # end), asked as the cancellation comes.
    keep_grace_s: Callable[[], float | None] | None = None


@dataclass(slots=True)
class RunResult:
    run_id: str
    stop: Stop
    message: dict[str, Any]
    finish_reason: str | None
    usage: Usage
    cost_usd: float | None
    steps: int
    tool_calls: int
    generated: list[dict[str, Any]]
    tools_ran: bool
    last_reply: ModelReply | None = None
    error: BaseException | None = None
    held: dict[str, Any] | None = None  # see `RunState.held`
    last_request: ModelRequest | None = None  # see `RunState.last_request`
    text: str = ""  # what the model said, every step's (`RunState.text`)

    @classmethod
    def of(cls, run: RunState, ending: Ending, error: BaseException | None) -> RunResult:
        return cls(
            run.run_id,
            ending.stop,
            ending.message,
            ending.finish_reason,
            run.usage,
            run.cost_usd,
            run.step_count,
            run.tool_calls,
            run.generated,
            run.tools_ran,
            run.last_reply,
            error,
            run.held,
            run.last_request,
            run.text,
        )


# What a run's caller keeps of it as it ends (a stored context's save, a stored response, the
# server calls it held back), awaited before the run is told as ended.
Keep = Callable[[RunResult], Awaitable[None]]
