"""A run's report is written before its answer, for a moment at most (`proxy.api.report_writes`):
a state backend that does not answer delays no answer longer, a report still being written is
read by `GET /v1/runs/{id}` once written, and the server calls a run held back from its client
are written as the run ends, before its answer, whatever it takes (the client's next request
needs them): a backend that fails them ends the run `state_unavailable`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from proxy.api.report_writes import ReportWrites
from proxy.api.services import RUN_RECORD
from proxy.state.memory import MemoryStore
from proxy.state.store import Record
from tests.integration.conftest import ProxyFactory
from tests.integration.counted_store import ForgetfulStore, StalledWrites
from tests.scripted_upstream import call, calls, say

ASK_USER = {"type": "function", "function": {"name": "ask_user", "parameters": {}}}


async def test_an_answer_does_not_wait_for_its_report_and_a_lookup_waits_for_it(
    proxy_for: ProxyFactory,
) -> None:
    store = StalledWrites()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(say("Hi."), say("Hi."))
        for stream in (False, True):
            r = await asyncio.wait_for(proxy.chat(model="scripted", stream=stream), 5)
            assert r.status_code == 200
        assert store.waiting == 2
        run_id = r.headers["x-loopwarden-run-id"]
        lookup = asyncio.create_task(proxy.client.get(f"/v1/runs/{run_id}"))
        await asyncio.sleep(0.2)
        assert not lookup.done()  # not a 404: its report is being written
        store.go.set()
        found = await asyncio.wait_for(lookup, 5)
    assert found.status_code == 200
    assert found.json()["run_id"] == run_id
    assert found.json()["stop_reason"] == "completed"


async def test_a_report_written_promptly_is_there_for_every_replica_before_the_answer(
    proxy_for: ProxyFactory,
) -> None:
    """Another worker or replica reads it from the backend alone: were it written after the
    answer, a client asking at once could get a 404 there."""
    store = MemoryStore()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(say("Hi."), say("Hi."))
        for stream in (False, True):
            r = await proxy.chat(model="scripted", stream=stream)
            found = await store.get_record(RUN_RECORD, r.headers["x-loopwarden-run-id"])
            assert found is not None


async def test_held_server_calls_are_written_before_the_answer(proxy_for: ProxyFactory) -> None:
    store = StalledWrites()
    async with proxy_for(store=store) as proxy:
        proxy.upstream.script(
            calls(call("get_weather", city="Oslo"), call("ask_user", question="Coat?"))
        )
        handing = asyncio.create_task(proxy.chat(model="weather", tools=[ASK_USER]))
        await asyncio.sleep(0.3)
        assert not handing.done()
        assert store.waiting == 1
        store.go.set()
        r = await asyncio.wait_for(handing, 5)
    assert r.json()["loop"]["stop_reason"] == "client_tool_call"


@pytest.mark.parametrize(
    ("path", "stream"),
    [("/v1/chat/completions", False), ("/v1/chat/completions", True), ("/v1/responses", False)],
)
async def test_held_server_calls_a_backend_fails_to_keep_fail_their_run(
    proxy_for: ProxyFactory, path: str, stream: bool
) -> None:
    """They were answered 200 (`client_tool_call`), a log line the only trace: the client's
    next request went upstream without them, and the model, not seeing its server call had
    run (a booking, say), could run it again."""
    async with proxy_for(store=ForgetfulStore()) as proxy:
        proxy.upstream.script(
            calls(call("get_weather", city="Oslo"), call("ask_user", question="Coat?"))
        )
        if path.endswith("completions"):
            r = await proxy.chat(model="weather", tools=[ASK_USER], stream=stream)
        else:
            tool = {"type": "function", "name": "ask_user", "parameters": {}}
            body = {"model": "weather", "input": "hi", "tools": [tool], "store": False}
            r = await proxy.client.post(path, json=body)
        scraped = (await proxy.client.get("/metrics")).text
    if stream:
        assert r.status_code == 200  # the stream began with the run's first text or call
        assert '"state_unavailable"' in r.text
    else:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "state_unavailable"
        assert r.json()["loop"]["stop_reason"] == "state_unavailable"
        assert r.headers["x-should-retry"] == "false"  # its server call ran
    assert 'stop_reason="state_unavailable"} 1.0' in scraped


async def test_past_its_bound_a_report_is_written_before_the_answer() -> None:
    store = StalledWrites()
    reports = ReportWrites(store, 60, max_pending=2)

    def keep(n: int) -> Awaitable[None]:
        return reports.keep(f"run_{n}", [Record("run", f"run_{n}", b"{}")])

    for n in range(2):
        await asyncio.wait_for(keep(n), 1)
    third = asyncio.create_task(keep(2))
    await asyncio.sleep(0.1)
    assert (reports.pending, third.done()) == (2, False)
    store.go.set()
    await asyncio.wait_for(third, 1)
    await reports.drain(1)
    assert reports.pending == 0
    assert [await store.get_record("run", f"run_{n}") for n in range(3)] == [b"{}"] * 3


async def test_a_report_the_backend_refuses_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    reports = ReportWrites(ForgetfulStore(), 60)
    await reports.keep("run_1", [Record("run", "run_1", b"{}")])
    await reports.written("run_1")
    assert "run run_1 was not kept: the state backend is unreachable" in caplog.text


async def test_reports_left_unwritten_at_shutdown_are_counted_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend that does not answer: the reports still being written when the drain ends
    were lost with a single line for the first of them."""
    reports = ReportWrites(StalledWrites(), 60, wait_s=0)
    for n in range(20):
        await reports.keep(f"run_{n}", [Record("run", f"run_{n}", b"{}")])
    await reports.drain(0.1)
    assert "20 run reports were not kept: still being written at shutdown" in caplog.text
    assert reports.pending == 0


async def test_a_run_s_later_report_is_written_last_and_one_asked_again_once() -> None:
    """A run's report written again as the drain's end cut its first try is that write; a
    later report of the run (its keep cut: `cancelled`) was dropped while the first
    (`completed`) was being written, and `GET /v1/runs/{id}` said `completed`."""
    store = StalledWrites()
    writes = ReportWrites(store, 60, wait_s=0.01)
    first = [Record(RUN_RECORD, "r1", b"completed")]
    await writes.keep("r1", first)
    await writes.keep("r1", list(first))
    assert store.waiting == 1
    await writes.keep("r1", [Record(RUN_RECORD, "r1", b"cancelled")])
    store.go.set()
    await asyncio.wait_for(writes.written("r1"), 5)
    assert await store.get_record(RUN_RECORD, "r1") == b"cancelled"
    assert writes.pending == 0
