"""A run's `keep` (a stored context's save): its last act, told with the run's end."""

from __future__ import annotations

import asyncio

import pytest

from proxy.engine import events as ev
from proxy.engine.run_spec import RunResult
from proxy.engine.stop import StopReason
from proxy.errors import StateUnavailable
from tests.fakes import reply
from tests.unit.harness import Harness


def finished(h: Harness) -> ev.RunFinished:
    (event,) = h.observer.of(ev.RunFinished)
    return event


async def test_a_keep_the_backend_refuses_ends_the_run_state_unavailable() -> None:
    async def refuse(result: RunResult) -> None:
        raise StateUnavailable("the context changed meanwhile")

    h = Harness([reply("done")])
    result = await h.run(keep=refuse)
    assert result.stop.reason is StopReason.STATE_UNAVAILABLE
    assert finished(h).stop.reason is StopReason.STATE_UNAVAILABLE


async def test_a_failed_run_is_not_kept() -> None:
    kept: list[RunResult] = []

    async def keep(result: RunResult) -> None:
        kept.append(result)

    h = Harness([reply(calls=[("search", "{}")])], {"search": lambda _: "s"},
                tool_call_limits=[{"run_limit": 0, "exit_behavior": "error"}])  # fmt: skip
    result = await h.run(keep=keep)
    assert result.stop.is_policy_failure
    assert kept == []


@pytest.mark.parametrize("cancels", [1, 2])
@pytest.mark.parametrize("fails", [False, True])
async def test_a_keep_begun_is_finished_though_the_client_leaves(
    cancels: int, fails: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Cut, the save went on in the backend's thread (sqlite) while the run was told as
    cancelled: the context held a reply its client never got, and its retry added it twice. A
    second cancellation left it running unwatched (its failure logged as never retrieved); a
    failure after the first replaced the cancellation (a result for a client that had left)."""
    entered, go, saved = asyncio.Event(), asyncio.Event(), []

    async def keep(result: RunResult) -> None:
        entered.set()
        await go.wait()
        if fails:
            raise StateUnavailable("the backend failed after the client left")
        saved.append(result.message["content"])

    h = Harness([reply("done")])
    running = asyncio.create_task(h.run(keep=keep))
    await asyncio.wait_for(entered.wait(), 5)
    for _ in range(cancels):
        running.cancel()
        await asyncio.sleep(0)
    assert not running.done()  # the save is awaited to its end
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await running
    told = StopReason.CANCELLED if fails else StopReason.COMPLETED
    assert saved == ([] if fails else ["done"])
    assert h.last_run.result is not None
    assert h.last_run.result.stop.reason is told
    assert finished(h).stop.reason is told
    assert "never retrieved" not in caplog.text
