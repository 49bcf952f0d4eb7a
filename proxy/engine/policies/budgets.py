"""Budgets hold (SPEC §6.2): stop before a step the run cannot afford, cap what it may spend."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import orjson

from proxy.engine.policies.base import Policy, StepPlan
from proxy.engine.policies.stop_conditions import Condition
from proxy.engine.state import RunState
from proxy.engine.stop import Stop, StopReason, limit_details
from proxy.engine.values import ModelReply, Prices

# The largest cap a budget puts on a step's completion: past it, no model's reply is cut short,
# and a larger one (a $1e14 budget over a price per token) would not fit the request's JSON.
MAX_CAP_TOKENS = 2**31 - 1


def estimate_prompt_tokens(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
    """A conservative prompt size: a token is never counted as more than 4 bytes."""
    size = len(orjson.dumps(messages)) + (len(orjson.dumps(tools)) if tools else 0)
    return math.ceil(size / 4)


class Budgets(Policy):
    """Enforces the token and cost conditions that hold on their own (top level or in `any`).

    A step whose reply reports no usage (an upstream that ignores `stream_options`, or sends
    none) is counted by estimate: its prompt as it was sized, its reply at most 4 bytes a token
    of its message: what it spent is not known, but never taken as nothing."""

    def __init__(self, conditions: Sequence[Condition], prices: Prices | None) -> None:
        leaves = [leaf for cond in conditions for leaf in cond.walk_any()]
        self.tokens = [c for c in leaves if c.kind == "max_tokens_used"]
        self.costs = [c for c in leaves if c.kind == "max_cost"]
        self.prices = prices
        self._cap_by: Condition | None = None
        self._prompt = 0  # the estimate of the step under way
        self._unreported_tokens = 0  # estimated, of the steps that reported no usage
        self._unreported_cost = 0.0

    def size_step(self, run: RunState, plan: StepPlan) -> Stop | None:
        self._cap_by = None
        if not self.tokens and not (self.costs and self.prices):
            return None
        prompt = self._prompt = estimate_prompt_tokens(
            run.messages + plan.extra_messages, plan.tools
        )
        used = run.usage.total_tokens + self._unreported_tokens
        cap: int | None = None
        cap_by: Condition | None = None
        for cond in self.tokens:
            room = int(cond.value) - used - prompt
            if room < 1:
                return self._stop(cond, run, used, prompt)
            if room <= MAX_CAP_TOKENS and (cap is None or room < cap):
                cap, cap_by = room, cond
        if self.prices is not None:
            spent = (run.cost_usd or 0.0) + self._unreported_cost
            for cond in self.costs:
                left = cond.value - spent - prompt * self.prices.input
                if self.prices.output <= 0:
                    if left <= 0:
                        return self._stop(cond, run, round(spent, 10), prompt)
                    continue
                tokens = left / self.prices.output  # may be inf, for a tiny price
                if tokens < 1:
                    return self._stop(cond, run, round(spent, 10), prompt)
                afford = math.floor(min(tokens, MAX_CAP_TOKENS + 1))
                if afford <= MAX_CAP_TOKENS and (cap is None or afford < cap):
                    cap, cap_by = afford, cond
        if cap is not None and (
            plan.max_completion_tokens is None or cap < plan.max_completion_tokens
        ):
            plan.max_completion_tokens = cap
            self._cap_by = cap_by
        return None

    def after_reply(self, run: RunState, plan: StepPlan, reply: ModelReply) -> Stop | None:
        """A reply cut short at the cap a budget imposed ends the run with that budget: one cut
        shorter (the client's own `max_tokens`, the model's own limit) is no budget's doing."""
        if not reply.usage.total_tokens:  # none reported
            completion = math.ceil(len(orjson.dumps(reply.message)) / 4)
            self._unreported_tokens += self._prompt + completion
            if self.prices is not None and reply.reported_cost_usd is None:
                cost = self._prompt * self.prices.input + completion * self.prices.output
                self._unreported_cost += cost
        cond = self._cap_by
        if cond is None or reply.finish_reason != "length":
            return None
        if 0 < reply.usage.completion_tokens < (plan.max_completion_tokens or 0):
            return None  # (a reply with no usage reported is taken as cut at the cap)
        if cond.kind == "max_tokens_used":
            observed: float = run.usage.total_tokens + self._unreported_tokens
        else:
            observed = round((run.cost_usd or 0.0) + self._unreported_cost, 10)
        return self._stop(cond, run, observed, None)

    @staticmethod
    def _stop(cond: Condition, run: RunState, observed: float, prompt: int | None) -> Stop:
        reason = (
            StopReason.TOKEN_BUDGET if cond.kind == "max_tokens_used" else StopReason.COST_BUDGET
        )
        before = {} if prompt is None else {"before_step": True, "estimated_prompt_tokens": prompt}
        details = limit_details(
            cond.path,
            cond.kind,
            run.step_count,
            threshold=cond.value,
            observed=observed,
            id=cond.id,
            **before,
        )
        return Stop(reason, details)
