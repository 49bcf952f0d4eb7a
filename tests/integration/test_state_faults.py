"""Faults of the state backend through the HTTP API: a redis-server stopped and started again,
a sqlite file deleted or made unwritable under the proxy. Each is an OpenAI-shaped 503
`state_unavailable` (and a run it cuts ends with that stop reason), and `/readyz` says so."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.demo.runner import free_port
from proxy.engine.events import RunFinished
from proxy.errors import StateUnavailable
from proxy.state import redis_calls
from proxy.state.lease import MAX_LATE_RELEASES
from proxy.state.redis import RedisStore
from proxy.state.sqlite import SqliteStore
from proxy.state.store import Record, StoredContext
from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import call, say
from tests.servers import redis_process, redis_server

CONFIG: dict[str, Any] = {
    "agents": {
        "reporter": {"model": "scripted", "tools": ["get_weather"]},
        "capped": {
            "model": "scripted",
            "tools": ["get_weather"],
            "tool_call_limits": [{"thread_limit": 5}],
        },
    }
}


def assert_state_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == "state_unavailable"
    assert error["type"] == "server_error"


async def chat(proxy: Proxy, context_id: str, **body: Any) -> httpx.Response:
    return await proxy.client.post("/chat", json={"context_id": context_id, **body})


async def assert_every_state_route_fails(proxy: Proxy, context_id: str, run_id: str) -> None:
    assert (await proxy.client.get("/readyz")).status_code == 503
    assert_state_unavailable(await chat(proxy, context_id, message="still there?"))
    assert_state_unavailable(await chat(proxy, "new", agent="reporter", message="hi"))
    assert_state_unavailable(await proxy.client.post("/chat/invoke", json={"context_id": "c"}))
    assert_state_unavailable(await proxy.client.get(f"/v1/contexts/{context_id}"))
    assert_state_unavailable(await proxy.client.delete(f"/v1/contexts/{context_id}"))
    assert_state_unavailable(await proxy.client.get(f"/v1/runs/{run_id}"))
    # A run with a thread limit reserves its calls in the backend: it is cut.
    proxy.upstream.script(call("get_weather", city="Lima"))
    cut = await proxy.chat(model="capped", loop={"thread_id": "t-1"})
    assert_state_unavailable(cut)
    [finished] = proxy.observer.of(RunFinished)[-1:]
    assert finished.stop.reason == "state_unavailable"
    assert finished.tool_calls == 0  # the call was not run without its reservation


@contextlib.contextmanager
def stopped(server: contextlib.AbstractContextManager[str]) -> Iterator[None]:
    server.__exit__(None, None, None)
    yield


async def test_redis_down_is_a_503_on_every_state_route_until_it_is_back(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    port = free_port()
    first = redis_server(tmp_path / "one", port)
    (tmp_path / "one").mkdir()
    url = first.__enter__()
    store = RedisStore(url, prefix=f"faults-{secrets.token_hex(4)}:", timeout_s=2)
    try:
        async with proxy_for(CONFIG, store=store) as proxy:
            proxy.upstream.script(say("Hi."))
            created = await chat(proxy, "c1", agent="reporter", message="hi")
            assert created.status_code == 200
            assert (await proxy.client.get("/readyz")).status_code == 200
            run_id = created.headers["x-loopwarden-run-id"]
            with stopped(first):
                await assert_every_state_route_fails(proxy, "c1", run_id)
            (tmp_path / "two").mkdir()
            with redis_server(tmp_path / "two", port):  # the same address, empty
                assert (await proxy.client.get("/readyz")).status_code == 200
                proxy.upstream.script(say("Back."))
                again = await chat(proxy, "c2", agent="reporter", message="hi")
                assert again.status_code == 200, again.text
    finally:
        await store.close()


async def test_a_deleted_sqlite_file_is_not_ready_and_a_503_not_a_fresh_start(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    try:
        async with proxy_for(CONFIG, store=store) as proxy:
            proxy.upstream.script(say("Hi."))
            created = await chat(proxy, "c1", agent="reporter", message="hi")
            assert created.status_code == 200
            assert (await proxy.client.get("/readyz")).status_code == 200
            remove(path)
            ready = await proxy.client.get("/readyz")
            assert ready.json()["detail"].endswith(
                "its file was deleted or replaced since the proxy opened it; restart the proxy "
                "once the file is back"
            )
            run_id = created.headers["x-loopwarden-run-id"]
            await assert_every_state_route_fails(proxy, "c1", run_id)
            SqliteStore(path)  # a new file in its place is not the one the proxy opened
            assert (await proxy.client.get("/readyz")).status_code == 503
    finally:
        await store.close()


def remove(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


@contextlib.contextmanager
def unwritable(path: Path) -> Iterator[None]:
    """`path` cannot be written, even through a descriptor already open: immutable (`chattr +i`,
    which needs root, as the test machines run)."""
    assert os.geteuid() == 0, "this test makes a file immutable: run the tests as root"
    subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


async def test_an_unwritable_sqlite_file_is_not_ready_and_a_503_not_a_crash(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    # An existing file, with its schema, from a process that has stopped (closed: sqlite may
    # hand a connection of this process a descriptor that another one left open).
    await SqliteStore(path).close()
    with unwritable(path):
        store = SqliteStore(path)  # opened as it is in a restart
        try:
            async with proxy_for(CONFIG, store=store) as proxy:
                ready = await proxy.client.get("/readyz")
                assert ready.status_code == 503
                assert "readonly" in ready.json()["detail"]
                assert_state_unavailable(await chat(proxy, "c1", agent="reporter", message="hi"))
        finally:
            await store.close()


async def test_a_sqlite_file_made_unwritable_while_open_is_not_ready(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    try:
        async with proxy_for(CONFIG, store=store) as proxy:
            proxy.upstream.script(say("Hi."))
            assert (await chat(proxy, "c1", agent="reporter", message="hi")).status_code == 200
            with unwritable(path):
                ready = await proxy.client.get("/readyz")
                assert ready.status_code == 503, ready.text
            assert (await proxy.client.get("/readyz")).status_code == 200
    finally:
        await store.close()


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_a_healthy_backend_is_ready(
    proxy_for: ProxyFactory, tmp_path: Path, backend: str
) -> None:
    state = {"backend": backend, "path": str(tmp_path / "state.db")}
    async with proxy_for({**CONFIG, "state": state}) as proxy:
        ready = await proxy.client.get("/readyz")
    assert ready.json() == {"status": "ready"}


async def test_with_the_rollback_journal_a_file_made_immutable_while_open_is_a_503(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    """WAL maps its `-shm` file, which the kernel answers with SIGBUS once it is immutable: the
    rollback journal maps nothing, so every fault of the file is an error of a call."""
    path = tmp_path / "state.db"
    state = {"backend": "sqlite", "path": str(path), "sqlite_journal": "rollback"}
    async with proxy_for({**CONFIG, "state": state}) as proxy:
        proxy.upstream.script(say("Hi."), say("Back."))
        assert (await chat(proxy, "c1", agent="reporter", message="hi")).status_code == 200
        with unwritable(path):
            assert (await proxy.client.get("/readyz")).status_code == 503
            assert_state_unavailable(await chat(proxy, "c1", message="again"))
            assert_state_unavailable(await proxy.client.delete("/v1/contexts/c1"))
        assert (await proxy.client.get("/readyz")).status_code == 200
        assert (await chat(proxy, "c1", message="again")).status_code == 200


async def test_a_redis_outage_is_told_in_the_log_once_a_second_not_once_a_call(
    proxy_for: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request's calls fail while redis is down: 900 requests made 1,104 lines. Those
    not told are counted when the store closes."""
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", prefix="down:", timeout_s=1)
    with caplog.at_level(logging.WARNING):
        try:
            async with proxy_for(CONFIG, store=store) as proxy:
                for i in range(30):
                    r = await chat(proxy, f"c{i}", agent="reporter", message="hi")
                    assert_state_unavailable(r)
            told = [m for m in caplog.messages if m.startswith("the redis state backend")]
            assert len(told) <= 1
        finally:
            await store.close()
    last = [m for m in caplog.messages if m.startswith("the redis state backend")][-1]
    untold = int(last.rsplit("(", 1)[1].split()[0])
    assert untold >= 29 - len(told)
    assert redis_calls.failures.untold == 0


@pytest.mark.parametrize(("timeout_s", "lease_s"), [(0.5, 10), (2.0, 1)])
async def test_a_save_a_paused_redis_runs_after_the_run_was_told_it_failed_saves_nothing(
    tmp_path: Path, timeout_s: float, lease_s: float
) -> None:
    """redis runs what was sent to it once it resumes: a run's last save, which had timed out
    (its client told 503 `state_unavailable`), saved its messages all the same (and, measured
    by the lock's lease, still did with a lease shorter than the timeout)."""
    with redis_process(tmp_path) as (url, server):
        store = RedisStore(url, prefix="late:", timeout_s=timeout_s, lock_lease_s=lease_s)
        try:
            await store.save_context(StoredContext("c", agent="a"))
            async with store.hold("c") as holding:  # (redis knows the scripts from now on)
                assert holding.context is not None
                await holding.end(holding.context, [], 60)
            async with store.hold("c") as holding:
                context = holding.context
                assert context is not None
                context.messages = [{"role": "user", "content": "told it failed"}]
                server.send_signal(signal.SIGSTOP)
                try:
                    with pytest.raises(StateUnavailable):
                        await holding.end(context, [Record("run", "r1", b"{}")], 60)
                finally:
                    server.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.2)  # what it held, run by now
            stored = await store.load_context("c")
            report = await store.get_record("run", "r1")
        finally:
            await store.close()
    assert stored is not None
    assert (stored.messages, stored.version, report) == ([], 2, None)


async def test_a_hold_a_paused_redis_takes_after_it_timed_out_is_let_go(tmp_path: Path) -> None:
    """redis runs what was sent to it once it resumes: a take that had timed out (its run told
    503) took the context's lock then, for no one, until its 30 s lease ran out."""
    with redis_process(tmp_path) as (url, server):
        store = RedisStore(url, prefix="late:", timeout_s=0.5, lock_lease_s=30)
        try:
            await store.save_context(StoredContext("c", agent="a"))
            async with store.hold("c") as holding:  # (redis knows the scripts from now on)
                assert holding.context is not None
                await holding.end(holding.context, [], 60)
            server.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(StateUnavailable):
                    async with store.hold("c"):
                        pass
            finally:
                server.send_signal(signal.SIGCONT)
            async with asyncio.timeout(10):  # not the lease's 30 s
                async with store.hold("c") as holding:
                    assert holding.context is not None
        finally:
            await store.close()


async def test_takes_that_fail_while_redis_is_down_leave_a_bounded_number_of_retries() -> None:
    """Each take that failed tried its let-go again for the whole lease: 2,000 requests during
    an outage left 2,000 tasks reconnecting for 30 s."""
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", prefix="down:", timeout_s=0.5)
    try:
        before = len(asyncio.all_tasks())
        for _ in range(300):
            with pytest.raises(StateUnavailable):
                async with store.hold("c"):
                    pass
        left = len(asyncio.all_tasks()) - before
    finally:
        await store.close()
    assert left <= MAX_LATE_RELEASES
