"""How the answers of a run's policies combine at each checkpoint of the loop.

- Every policy hears what happened (`after_reply`, `after_tool`): each may keep state.
- Where policies answer, the first answer wins, in the order of `LoopPolicy.build`.
- Planning has two phases: policies shape the step (`before_step`), then, with the plan final,
  they size it (`size_step`: budgets cap the tokens of what will actually be sent).
- Reviewing a call has two phases: every policy may block it (`refusal`: `review_call`); only
  when none did (and its tool takes its arguments), a policy may reserve shared counters
  (`admit`: `reserve`), so no reservation is taken for a call that is blocked or fails at
  once. At most one policy reserves.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.engine.policies.base import Block, Nudge, Policy, StepPlan
from proxy.engine.state import RunState
from proxy.engine.stop import Stop
from proxy.engine.values import ModelReply, ToolCall, ToolResult


class Checkpoints:
    """A run's policies, asked at each checkpoint of the loop as the module says."""

    def __init__(self, policies: Sequence[Policy]) -> None:
        self.policies = tuple(policies)

    def before_step(self, run: RunState, plan: StepPlan) -> Stop | None:
        """Every policy shapes the step, then sizes it: the first stop wins."""
        for policy in self.policies:
            stop = policy.before_step(run, plan)
            if stop is not None:
                return stop
        for policy in self.policies:
            stop = policy.size_step(run, plan)
            if stop is not None:
                return stop
        return None

    def allows_final(self, run: RunState, plan: StepPlan) -> bool:
        """Whether every policy allows the final-answer call (each sizes it as it goes)."""
        return all(policy.allows_final(run, plan) for policy in self.policies)

    def after_reply(self, run: RunState, plan: StepPlan, reply: ModelReply) -> Stop | None:
        """Every policy hears the reply; the first stop wins."""
        stops = [policy.after_reply(run, plan, reply) for policy in self.policies]
        return next((stop for stop in stops if stop is not None), None)

    async def refusal(self, run: RunState, call: ToolCall) -> Block | None:
        """The reviews (`review_call`: the tool rules'), which take nothing: None when every
        policy lets the call through."""
        for policy in self.policies:
            block = await policy.review_call(run, call)
            if block is not None:
                return block
        return None

    async def admit(self, run: RunState, call: ToolCall) -> Block | None:
        """A call that passed the reviews, to be executed: a policy may take shared counters
        for it (`reserve`) or block it; None: admitted, and every policy is told."""
        for policy in self.policies:
            block = await policy.reserve(run, call)
            if block is not None:
                return block
        for policy in self.policies:
            policy.admit(run, call)
        return None

    async def unreserve(self, run: RunState, calls: Sequence[ToolCall]) -> None:
        """Admitted calls that never ran: every policy gives back what it took for them."""
        for policy in self.policies:
            await policy.unreserve(run, calls)

    def decides_next(self, call: ToolCall) -> bool:
        """Whether some policy needs `call`'s result to review the calls after it."""
        return any(policy.decides_next(call) for policy in self.policies)

    def after_tool(self, run: RunState, call: ToolCall, result: ToolResult) -> Stop | None:
        """Every policy hears the call's result; the first stop wins."""
        stops = [policy.after_tool(run, call, result) for policy in self.policies]
        return next((stop for stop in stops if stop is not None), None)

    def after_reply_without_tools(self, run: RunState, reply: ModelReply) -> Nudge | Stop | None:
        """The first policy's nudge or stop for a reply that would end the run; None: it ends."""
        for policy in self.policies:
            verdict = policy.after_reply_without_tools(run, reply)
            if verdict is not None:
                return verdict
        return None

    async def after_step(self, run: RunState) -> Stop | None:
        """The first stop of a policy's conditions after a step that would go on."""
        for policy in self.policies:
            stop = await policy.after_step(run)
            if stop is not None:
                return stop
        return None
