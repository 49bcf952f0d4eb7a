"""SPEC §9: tool call limits per run and per thread, with each exit behaviour."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from proxy.engine import events as ev
from proxy.engine.stop import StopReason
from proxy.engine.values import ModelReply
from proxy.errors import StateUnavailable
from proxy.state.memory import MemoryStore
from tests.fakes import reply
from tests.unit.harness import Harness, problem

TOOLS = {"search": lambda _: "s", "fetch": lambda _: "f"}


def searches(n: int) -> list[Any]:
    return [reply(calls=[("search", "{}")]) for _ in range(n)]


def errors(generated: list[dict[str, Any]]) -> list[str]:
    return [
        json.loads(m["content"])["error"]
        for m in generated
        if m["role"] == "tool" and m["content"].startswith('{"error"')
    ]


async def test_continue_blocks_the_call_past_the_run_limit_and_goes_on() -> None:
    h = Harness(
        [*searches(3), reply("done")],
        TOOLS,
        tool_call_limits=[{"tool_name": "search", "run_limit": 2}],
    )
    result = await h.run()
    assert len(h.tools.calls) == 2
    assert errors(result.generated) == [
        "Tool call limit exceeded (run: 2/2). Do not call 'search' again."
    ]
    (blocked,) = h.observer.of(ev.CallBlocked)
    assert blocked.outcome == "blocked_limit"
    assert result.stop.reason is StopReason.COMPLETED
    assert result.tool_calls == 2


async def test_error_fails_the_run_and_skips_the_rest_of_the_reply() -> None:
    h = Harness(
        [reply(calls=[("search", "{}"), ("search", "{}"), ("fetch", "{}")])],
        TOOLS,
        tool_call_limits=[{"run_limit": 1, "exit_behavior": "error"}],
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TOOL_CALL_LIMIT
    assert result.stop.error_code == "tool_call_limit_exceeded"
    assert result.stop.is_policy_failure
    assert [c[0] for c in h.tools.calls] == ["search"]
    assert errors(result.generated)[1] == "Not executed: the run has stopped."
    assert result.stop.details["kind"] == "run_limit"
    assert result.stop.details["threshold"] == 1
    assert result.stop.details["observed"] == 1


async def test_end_stops_the_run_with_a_message_stating_the_limit() -> None:
    h = Harness(
        searches(3),
        {"search": lambda _: "s"},
        tool_call_limits=[{"tool_name": "search", "run_limit": 2, "exit_behavior": "end"}],
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TOOL_CALL_LIMIT
    assert not result.stop.is_policy_failure
    assert result.finish_reason == "stop"
    assert result.message["content"] == (  # for the user: the model's message is its own
        "Stopped: the run reached a tool call limit (run: 2/2) calling search."
    )
    assert result.stop.details["message"] == (
        "Tool call limit exceeded (run: 2/2). Do not call 'search' again."
    )
    assert result.stop.details["condition"] == "tool_call_limits[0]"


async def test_end_with_final_answer_asks_the_model_once_more() -> None:
    h = Harness(
        [*searches(2), reply("summary")],
        {"search": lambda _: "s"},
        final_answer=True,
        tool_call_limits=[{"run_limit": 1, "exit_behavior": "end"}],
    )
    result = await h.run()
    assert result.message["content"] == "summary"
    assert result.stop.details["final_answer"] is True
    assert h.model.requests[-1].tool_choice == "none"


async def test_thread_counts_persist_across_runs_on_one_thread() -> None:
    store = MemoryStore()
    limits = [{"tool_name": "search", "thread_limit": 3}]
    first = Harness(
        [*searches(2), reply("a")], TOOLS, tool_call_limits=limits, threads=store, thread_id="t1"
    )
    await first.run()
    second = Harness(
        [*searches(2), reply("b")], TOOLS, tool_call_limits=limits, threads=store, thread_id="t1"
    )
    result = await second.run()
    assert len(second.tools.calls) == 1
    assert errors(result.generated) == [
        "Tool call limit exceeded (thread: 3/3). Do not call 'search' again."
    ]
    other = Harness(
        [*searches(2), reply("c")], TOOLS, tool_call_limits=limits, threads=store, thread_id="t2"
    )
    await other.run()
    assert len(other.tools.calls) == 2
    assert await store.thread_counts("t1") == {"search": 3}


async def test_a_run_limit_s_message_gives_the_thread_s_count() -> None:
    """The thread held 2 calls of earlier runs: the run limit is hit at this run's first call,
    and the message states the thread's count, not the run's (SPEC §9)."""
    store = MemoryStore()
    await store.reserve("t1", {"search": 5})
    await store.reserve("t1", {"search": 5})
    limits = [{"tool_name": "search", "thread_limit": 5, "run_limit": 1}]
    h = Harness(
        [*searches(2), reply("a")], TOOLS, tool_call_limits=limits, threads=store, thread_id="t1"
    )
    result = await h.run()
    assert errors(result.generated) == [
        "Tool call limit exceeded (thread: 3/5, run: 1/1). Do not call 'search' again."
    ]


class CountsUnreadable(MemoryStore):
    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        raise StateUnavailable("the state backend is unreachable")


async def test_a_run_limit_s_message_without_the_thread_s_count_when_it_cannot_be_read() -> None:
    """The call is blocked all the same, and the run goes on: only its message says less."""
    limits = [{"tool_name": "search", "thread_limit": 5, "run_limit": 1}]
    h = Harness(
        [*searches(2), reply("a")],
        TOOLS,
        tool_call_limits=limits,
        threads=CountsUnreadable(),
        thread_id="t1",
    )
    result = await h.run()
    assert result.stop.reason is StopReason.COMPLETED
    assert errors(result.generated) == [
        "Tool call limit exceeded (run: 1/1). Do not call 'search' again."
    ]


async def test_without_a_thread_id_the_thread_is_the_run() -> None:
    store = MemoryStore()
    limits = [{"thread_limit": 2, "run_limit": 1}]
    h = Harness([*searches(2), reply("a")], TOOLS, tool_call_limits=limits, threads=store)
    result = await h.run()
    assert len(h.tools.calls) == 1
    assert errors(result.generated) == [
        "Tool call limit exceeded (thread: 1/2, run: 1/1). Do not call any tool again."
    ]
    assert await store.thread_counts("run_test") == {}


async def test_a_limit_without_tool_name_counts_every_tool() -> None:
    h = Harness(
        [reply(calls=[("search", "{}"), ("fetch", "{}"), ("fetch", "{}")]), reply("done")],
        TOOLS,
        tool_call_limits=[{"run_limit": 2}],
    )
    result = await h.run()
    assert [c[0] for c in h.tools.calls] == ["search", "fetch"]
    assert errors(result.generated) == [
        "Tool call limit exceeded (run: 2/2). Do not call any tool again."
    ]


@pytest.mark.parametrize("threads", [None, MemoryStore()])
async def test_a_run_limit_does_not_loosen_a_stricter_thread_limit_the_call_reaches_too(
    threads: MemoryStore | None,
) -> None:
    """A `continue` limit on the run (a request's) and an `error` limit on the thread (the
    agent's) both reached at one call: the run fails, as it would with the agent's alone."""
    limits = [
        {"tool_name": "search", "thread_limit": 1, "exit_behavior": "error"},
        {"tool_name": "search", "run_limit": 1},
    ]
    h = Harness(
        [*searches(2), reply("a")],
        TOOLS,
        tool_call_limits=limits,
        threads=threads,
        thread_id="t1" if threads else None,
    )
    result = await h.run()
    assert result.stop.reason is StopReason.TOOL_CALL_LIMIT
    assert result.stop.error_code == "tool_call_limit_exceeded"
    assert result.stop.details["kind"] == "thread_limit"
    assert result.stop.details["condition"] == "tool_call_limits[0]"
    assert len(h.tools.calls) == 1


async def test_a_run_limit_stricter_than_the_thread_limit_reached_with_it_decides() -> None:
    limits = [
        {"tool_name": "search", "thread_limit": 1},
        {"tool_name": "search", "run_limit": 1, "exit_behavior": "end"},
    ]
    h = Harness([*searches(2), reply("a")], TOOLS, tool_call_limits=limits)
    result = await h.run()
    assert result.stop.reason is StopReason.TOOL_CALL_LIMIT
    assert result.stop.details["kind"] == "run_limit"
    assert not result.stop.is_policy_failure


async def test_calls_blocked_by_a_rule_do_not_count() -> None:
    h = Harness(
        [reply(calls=[("fetch", "{}")]), *searches(2), reply(calls=[("fetch", "{}")]), reply("x")],
        TOOLS,
        tool_rules=[{"type": "run_first", "tool_name": "search"}],
        tool_call_limits=[{"run_limit": 3}],
    )
    await h.run()
    assert [c[0] for c in h.tools.calls] == ["search", "search", "fetch"]


async def test_concurrent_runs_on_one_thread_never_pass_the_thread_limit() -> None:
    store = MemoryStore()
    harnesses = [
        Harness(
            [*searches(4), reply("x")],
            TOOLS,
            tool_call_limits=[{"tool_name": "search", "thread_limit": 7}],
            threads=store,
            thread_id="shared",
        )
        for _ in range(6)
    ]
    await asyncio.gather(*(h.run() for h in harnesses))
    assert sum(len(h.tools.calls) for h in harnesses) == 7
    assert await store.thread_counts("shared") == {"search": 7}


@pytest.mark.parametrize(
    ("limits", "param", "message"),
    [
        ([{"tool_name": "search"}], "tool_call_limits[0]", "set run_limit, thread_limit or both"),
        (
            [{"run_limit": 5, "thread_limit": 2}],
            "tool_call_limits[0].run_limit",
            "cannot be larger",
        ),
        (
            [{"run_limit": 1, "exit_behavior": "stop"}],
            "tool_call_limits[0].exit_behavior",
            "'continue', 'error' or 'end'",
        ),
        ([{"run_limit": 1, "per": "day"}], "tool_call_limits[0].per", "unknown field"),
        ([{"run_limit": -1}], "tool_call_limits[0].run_limit", "greater than or equal to 0"),
        ([{"run_limit": "3"}], "tool_call_limits[0].run_limit", "integer"),
        ({"run_limit": 1}, "tool_call_limits", "list"),
    ],
)
def test_malformed_limits_name_the_bad_field(limits: Any, param: str, message: str) -> None:
    path, said = problem({"tool_call_limits": limits})
    assert path == param
    assert message in said


@pytest.mark.parametrize(
    ("limit", "param", "message"),
    [
        (
            {"tool_name": "nope", "run_limit": 1},
            "tool_call_limits[0].tool_name",
            "not a server tool",
        ),
        (
            {"tool_name": "search", "run_limit": 1, "exit_behavior": "end"},
            "tool_call_limits[0].exit_behavior",
            "cannot stop other tools of the same reply (fetch)",
        ),
    ],
)
def test_limits_are_checked_against_the_run_tools(
    limit: dict[str, Any], param: str, message: str
) -> None:
    path, said = problem({"tool_call_limits": [limit]}, ("search", "fetch"))
    assert path == param
    assert message in said
    every_tool = {"tool_call_limits": [{"run_limit": 1, "exit_behavior": "end"}]}
    with pytest.raises(AssertionError, match="has no problem"):
        problem(every_tool, ("search", "fetch"))


class StallingAfter(MemoryStore):
    """Thread counters whose reservations past the first `answered` never answer."""

    def __init__(self, answered: int) -> None:
        super().__init__()
        self.answered = answered

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int], ttl_s: float | None = None
    ) -> tuple[bool, dict[str, int]]:
        if self.answered == 0:
            await asyncio.sleep(3600)
        self.answered -= 1
        return await super().reserve(thread_id, limits, ttl_s)


async def cut_by_the_time_budget(script: list[ModelReply], threads: StallingAfter) -> Harness:
    """A run of parallel calls with a thread limit on `search`, on thread "t", that its time
    budget of 0.3 s ends."""
    h = Harness(
        script,
        TOOLS,
        parallel=True,
        stop_when=[{"max_duration_s": 0.3}],
        tool_call_limits=[{"tool_name": "search", "thread_limit": 5}],
        threads=threads,
        thread_id="t",
    )
    h.deps = replace(h.deps, clock=time.monotonic)
    result = await asyncio.wait_for(h.run(), timeout=30)
    assert result.stop.reason is StopReason.TIME_BUDGET
    return h


async def test_calls_the_run_s_end_cuts_before_they_ran_give_back_their_reservations() -> None:
    """Parallel calls are admitted one by one, then run together: the time budget that ends
    the run while the third is reviewed leaves the first two unrun (SPEC §9: only executed
    calls count)."""
    threads = StallingAfter(2)
    h = await cut_by_the_time_budget([reply("checking", calls=[("search", "{}")] * 3)], threads)
    assert h.tools.calls == []
    assert await threads.thread_counts("t") == {"search": 0}


@pytest.mark.parametrize("caps", [(1, 5), (5, 1)])
async def test_two_thread_limits_on_one_tool_hold_the_stricter(caps: tuple[int, int]) -> None:
    threads = MemoryStore()
    h = Harness(
        [*searches(3), reply("done")],
        TOOLS,
        tool_call_limits=[{"tool_name": "search", "thread_limit": cap} for cap in caps],
        threads=threads,
        thread_id="t",
    )
    result = await h.run()
    assert len(h.tools.calls) == 1
    assert await threads.thread_counts("t") == {"search": 1}
    assert result.stop.reason is StopReason.COMPLETED


def with_ids(scripted: ModelReply, *ids: str) -> ModelReply:
    """`scripted` with its calls' ids as given (upstreams repeat them across replies)."""
    calls = [replace(c, id=i) for c, i in zip(scripted.tool_calls, ids, strict=True)]
    message = {**scripted.message, "tool_calls": [c.to_openai() for c in calls]}
    return replace(scripted, tool_calls=calls, message=message)


async def test_a_call_cut_before_it_ran_gives_back_its_own_reservation_only() -> None:
    """An earlier reply's call that ran had the same id as one cut: the reservation given
    back was the one that ran."""
    threads = StallingAfter(1)
    script = [
        with_ids(reply(calls=[("search", "{}")]), "call_0"),
        with_ids(reply(calls=[("fetch", "{}"), ("search", "{}")]), "call_0", "call_1"),
    ]
    h = await cut_by_the_time_budget(script, threads)
    assert [name for name, _ in h.tools.calls] == ["search"]
    assert await threads.thread_counts("t") == {"search": 1}


class SlowToShowCalls:
    """A client's stream that takes a second to show each call as it starts."""

    def heard(self, head: Mapping[str, str]) -> None:
        pass

    async def begin(self) -> None:
        pass

    async def content(self, text: str) -> None:
        pass

    async def progress(self, event: ev.RunEvent) -> None:
        if isinstance(event, ev.ToolStarted):
            await asyncio.sleep(1)


async def test_a_call_cut_as_its_start_was_shown_gives_back_its_reservation() -> None:
    threads = MemoryStore()
    h = Harness(
        [reply(calls=[("search", "{}")])],
        TOOLS,
        stop_when=[{"max_duration_s": 0.3}],
        tool_call_limits=[{"tool_name": "search", "thread_limit": 5}],
        threads=threads,
        thread_id="t",
    )
    h.deps = replace(h.deps, clock=time.monotonic)
    result = await asyncio.wait_for(h.run(stream=SlowToShowCalls()), timeout=30)
    assert result.stop.reason is StopReason.TIME_BUDGET
    assert h.tools.calls == []
    assert await threads.thread_counts("t") == {"search": 0}
