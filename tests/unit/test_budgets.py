"""SPEC §6.2: budgets hold before and during each step."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from proxy.engine.policies.budgets import estimate_prompt_tokens
from proxy.engine.stop import StopReason
from proxy.engine.tool_calls import CUT_SHORT, NOT_EXECUTED
from proxy.engine.values import (
    DeltaSink,
    ModelReply,
    ModelRequest,
    Prices,
    ToolCall,
    ToolContext,
    ToolResult,
)
from tests.fakes import FakeTools, reply
from tests.unit.harness import Harness

TOOLS = {"search": lambda _: "r" * 40}


def honouring(prompt_tokens: int, wants: int) -> Any:
    """A model that honours max_completion_tokens and reports an exact prompt size."""

    def answer(request: ModelRequest) -> Any:
        cap = request.max_completion_tokens
        if cap is not None and cap < wants:
            return reply("cut", prompt=prompt_tokens, completion=cap, finish="length")
        return reply(calls=[("search", "{}")], prompt=prompt_tokens, completion=wants)

    return answer


def test_estimate_counts_four_bytes_a_token_rounded_up() -> None:
    messages = [{"role": "user", "content": "x"}]
    assert estimate_prompt_tokens(messages, []) == 8  # 31 bytes of compact JSON


async def test_token_budget_caps_the_completion_and_never_passes() -> None:
    h = Harness([honouring(20, 60)] * 20, TOOLS, stop_when=[{"max_tokens_used": 200}])
    result = await h.run()
    assert result.stop.reason is StopReason.TOKEN_BUDGET
    assert result.usage.total_tokens <= 200
    caps = [r.max_completion_tokens for r in h.model.requests]
    assert all(c is not None for c in caps)


async def test_a_budget_in_an_any_is_reported_with_its_id() -> None:
    """SPEC §6: every entry may carry `id`: a budget's stop in an `any` lost the `any`'s."""
    named = {"id": "limits", "any": [{"max_tokens_used": 200}, {"step_count_is": 99}]}
    h = Harness([honouring(20, 60)] * 20, TOOLS, stop_when=[named])
    result = await h.run()
    assert result.stop.reason is StopReason.TOKEN_BUDGET
    assert (result.stop.details["condition"], result.stop.details["id"]) == (
        "stop_when[0].any[0]",
        "limits",
    )


async def test_budget_stop_before_a_step_it_cannot_afford_makes_no_call() -> None:
    h = Harness(
        [reply(calls=[("search", "{}")], prompt=90, completion=5)] * 3,
        TOOLS,
        stop_when=[{"max_tokens_used": 100}],
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TOKEN_BUDGET
    assert len(h.model.requests) == 1
    assert result.stop.details["before_step"] is True
    assert result.usage.total_tokens == 95


async def test_cost_budget_caps_with_known_prices() -> None:
    prices = Prices(input=1e-6, output=1e-5)
    h = Harness([honouring(50, 400)] * 30, TOOLS, stop_when=[{"max_cost": 0.01}], prices=prices)
    result = await h.run()
    assert result.stop.reason is StopReason.COST_BUDGET
    assert result.cost_usd is not None
    assert result.cost_usd <= 0.01


async def test_a_budget_too_large_to_cut_any_reply_puts_no_cap_on_it() -> None:
    """$1e308 over a price per token is an infinite number of tokens; $1e14 a number past
    64 bits: neither is a cap (nor a failure of the run), and a smaller budget's cap still is."""
    prices = Prices(input=1e-6, output=1e-7)
    for budgets in ([{"max_cost": 1e308}], [{"max_cost": 1e14}, {"max_tokens_used": 2**62}]):
        h = Harness([reply("ok")], TOOLS, stop_when=budgets, prices=prices)
        result = await h.run()
        assert result.stop.reason is StopReason.COMPLETED
        assert h.model.requests[0].max_completion_tokens is None
    both = [{"max_cost": 1e14}, {"max_tokens_used": 1_000}]
    h = Harness([reply("ok")], TOOLS, stop_when=both, prices=prices)
    await h.run()
    request = h.model.requests[0]
    prompt = estimate_prompt_tokens(request.messages, request.tools)
    assert request.max_completion_tokens == 1_000 - prompt


async def test_client_cap_wins_when_smaller() -> None:
    h = Harness(
        [reply("ok")], TOOLS, stop_when=[{"max_tokens_used": 10_000}], max_completion_tokens=7
    )
    await h.run()
    assert h.model.requests[0].max_completion_tokens == 7


async def test_a_reply_cut_short_of_the_budget_s_cap_is_no_budget_stop() -> None:
    """Cut at 50 tokens (the client's own `max_tokens`, or the model's own limit) under a
    budget that capped the step at hundreds: the run completed, as the model ended it."""
    h = Harness(
        [reply("cut", prompt=20, completion=50, finish="length")],
        TOOLS,
        stop_when=[{"max_tokens_used": 1000}],
    )
    result = await h.run()
    assert h.model.requests[0].max_completion_tokens is not None  # the budget's cap
    assert (result.stop.reason, result.finish_reason) == (StopReason.COMPLETED, "length")


async def test_a_reply_cut_short_with_no_usage_reported_is_taken_as_cut_at_the_cap() -> None:
    h = Harness(
        [reply("cut", prompt=0, completion=0, finish="length")],
        TOOLS,
        stop_when=[{"max_tokens_used": 1000}],
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TOKEN_BUDGET


@pytest.mark.parametrize(
    ("condition", "prices", "cost"),
    [
        ({"max_tokens_used": 600}, None, None),
        ({"max_cost": 0.0006}, Prices(input=1e-6, output=1e-6), None),
        ({"max_tokens_used": 600}, None, 0.0001),  # a cost reported, no tokens
    ],
)
async def test_a_budget_holds_against_an_upstream_that_reports_no_usage(
    condition: dict[str, Any], prices: Prices | None, cost: float | None
) -> None:
    """Each step's tokens are estimated (the prompt as sized, the reply at 4 bytes a token):
    the run stops at its third step, where it went on until the next prompt alone passed the
    budget (its sixth), the steps before counted as nothing."""
    h = Harness(
        [reply("x" * 200, calls=[("search", "{}")], prompt=0, completion=0, cost=cost)] * 30,
        TOOLS,
        stop_when=[condition],
        prices=prices,
    )
    result = await h.run()
    assert result.stop.reason in (StopReason.TOKEN_BUDGET, StopReason.COST_BUDGET)
    assert result.stop.details["before_step"] is True
    assert result.stop.details["observed"] > 0  # what the steps before spent, estimated
    assert result.steps == 3


async def test_budget_inside_all_is_not_a_hard_cap() -> None:
    cond = {"all": [{"max_tokens_used": 10}, {"step_count_is": 2}]}
    h = Harness([reply(calls=[("search", "{}")])] * 3, TOOLS, stop_when=[cond])
    result = await h.run()
    assert h.model.requests[0].max_completion_tokens is None
    assert result.stop.reason is StopReason.CUSTOM_CONDITION


class Stalling:
    """A model that never answers: an upstream that keeps the connection open."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None) -> ModelReply:
        self.asked.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


async def test_a_cancelled_run_with_a_time_budget_is_cancelled_not_out_of_time() -> None:
    """Cancelling a run (its client left) while a budgeted step waits is not the budget: the
    cancellation goes on."""
    h = Harness([], TOOLS, stop_when=[{"max_duration_s": 30}])  # (armed, far from over)
    stalling = Stalling()
    h.deps = replace(h.deps, model=stalling, clock=time.monotonic)
    run = asyncio.create_task(h.run())
    await stalling.asked.wait()  # the budgeted step waits on the upstream
    run.cancel()
    with pytest.raises(asyncio.CancelledError):  # not a result: the run did not return
        await run


async def test_the_time_budget_holds_while_the_run_waits_on_the_upstream() -> None:
    h = Harness([], TOOLS, stop_when=[{"any": [{"max_duration_s": 60}, {"max_duration_s": 0.2}]}])
    h.deps = replace(h.deps, model=Stalling(), clock=time.monotonic)
    started = time.monotonic()
    result = await asyncio.wait_for(h.run(), timeout=30)
    assert result.stop.reason is StopReason.TIME_BUDGET
    assert result.stop.details["condition"] == "stop_when[0].any[1]"
    assert result.stop.details["threshold"] == 0.2
    assert 0.2 <= result.stop.details["observed"] < 30
    assert time.monotonic() - started < 30
    assert result.message["content"] == "Stopped: the run reached its time budget (0.2 s)."


class SlowSearch(FakeTools):
    """`search` runs until it is cut short; the other tools answer at once."""

    async def execute(
        self, call: ToolCall, ctx: ToolContext, arguments: dict[str, Any] | None = None
    ) -> ToolResult:
        if call.name == "search":
            await asyncio.sleep(3600)
        return await super().execute(call, ctx, arguments)


@pytest.mark.parametrize("parallel", [False, True])
async def test_a_step_the_time_budget_cuts_keeps_its_calls_in_the_history(
    parallel: bool,
) -> None:
    """The calls began (one ended): the reply and every call that began stay in the history,
    a cut one answered as cut short, so a stored context's next run sees them and does not run
    them again (they were lost: `generated` held nothing of the step)."""
    calls = [("fetch", '{"n": 1}'), ("search", "{}")]
    h = Harness(
        [reply("working", calls=calls)],
        {**TOOLS, "fetch": lambda _: "fetched"},
        stop_when=[{"max_duration_s": 0.2}],
        parallel=parallel,
    )
    h.deps = replace(h.deps, tools=SlowSearch(h.tools.functions), clock=time.monotonic)
    result = await asyncio.wait_for(h.run(), timeout=30)
    assert result.stop.reason is StopReason.TIME_BUDGET
    assert result.tool_calls == 2
    assistant, fetched, cut = result.generated[:3]
    assert assistant["content"] == "working"
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["fetch", "search"]
    ids = [c["id"] for c in assistant["tool_calls"]]
    assert [fetched["tool_call_id"], cut["tool_call_id"]] == ids
    assert fetched["content"] == "fetched"
    assert json.loads(cut["content"]) == {"error": CUT_SHORT}


class StallingThreads:
    """Thread counters whose reservation never answers: a call cut under review."""

    async def reserve(self, thread_id: str, caps: dict[str, int]) -> tuple[bool, dict[str, int]]:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        return {}

    async def release(self, thread_id: str, counts: Mapping[str, int]) -> None:
        raise AssertionError("nothing was reserved")


async def test_a_call_the_time_budget_cuts_before_it_ran_is_answered_as_not_executed() -> None:
    h = Harness(
        [reply("checking", calls=[("search", "{}")])],
        TOOLS,
        stop_when=[{"max_duration_s": 0.2}],
        tool_call_limits=[{"tool_name": "search", "thread_limit": 5}],
        threads=StallingThreads(),
        thread_id="t",
    )
    h.deps = replace(h.deps, clock=time.monotonic)
    result = await asyncio.wait_for(h.run(), timeout=30)
    assert result.stop.reason is StopReason.TIME_BUDGET
    assert h.tools.calls == []
    _, answer = result.generated[:2]
    assert json.loads(answer["content"]) == {"error": NOT_EXECUTED}
