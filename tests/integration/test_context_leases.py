"""A run whose hold on its context was lost (its lease expired while it ran) does not overwrite
the save of the run that took the context next: it fails with 503 `state_unavailable`.
Two proxies share one backend, as two processes would: a sqlite file, or a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.errors import StateUnavailable
from proxy.state.redis import RedisStore
from proxy.state.sqlite import SqliteStore
from proxy.state.store import Record, StateStore, StoredContext
from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import call, keep, say

_entered: dict[str, asyncio.Event] = {}
_opened: dict[str, asyncio.Event] = {}


async def gate(name: str) -> str:
    """A tool that waits until the test opens its gate: a run that is still running."""
    _entered[name].set()
    await _opened[name].wait()
    return "opened"


CONFIG: dict[str, Any] = {
    "tools": {"gate": {"kind": "python", "callable": f"{__name__}:gate"}},
    "agents": {"gated": {"model": "scripted", "tools": ["gate"]}},
}


async def chat(proxy: Proxy, message: str) -> Any:
    return await proxy.client.post("/chat", json={"context_id": "c", "message": message})


@contextlib.asynccontextmanager
async def two_stores(
    backend: str, tmp_path: Path, redis_url: str
) -> AsyncIterator[tuple[StateStore, StateStore, Any]]:
    """Two stores on one backend, and what makes the lease on context 'c' expire now."""
    if backend == "sqlite":
        path = tmp_path / "state.db"
        stores: list[Any] = [SqliteStore(path), SqliteStore(path)]

        async def expire() -> None:
            await asyncio.to_thread(_delete_lock_row, path)

    else:
        prefix = f"lease-{secrets.token_hex(4)}:"
        stores = [RedisStore(redis_url, prefix=prefix), RedisStore(redis_url, prefix=prefix)]
        client = aioredis.Redis.from_url(redis_url)

        async def expire() -> None:
            assert await client.delete(f"{prefix}lock:c") == 1

    try:
        yield stores[0], stores[1], expire
    finally:
        for store in stores:
            await store.close()
        if backend == "redis":
            await client.aclose()


def _delete_lock_row(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("DELETE FROM context_locks WHERE id = 'c'").rowcount == 1
        db.commit()


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_a_run_that_lost_its_lease_fails_instead_of_overwriting_the_next(
    proxy_for: ProxyFactory, tmp_path: Path, redis_url: str, backend: str
) -> None:
    _entered["g"], _opened["g"] = asyncio.Event(), asyncio.Event()
    async with (
        two_stores(backend, tmp_path, redis_url) as (one, two, expire),
        proxy_for(CONFIG, store=one) as first,
        proxy_for(CONFIG, store=two) as second,
    ):
        first.upstream.script(say("Ready."))
        created = await first.client.post(
            "/chat", json={"context_id": "c", "agent": "gated", "message": "start"}
        )
        assert created.status_code == 200
        # The late run asks for the gate, the next one answers at once, then the late one.
        first.upstream.script(call("gate", name="g"), say("Second."), say("Late."))
        late = asyncio.ensure_future(chat(first, "late"))
        await asyncio.wait_for(_entered["g"].wait(), 10)  # the late run holds the context
        await expire()
        taken = await chat(second, "second")
        _opened["g"].set()
        lost = await asyncio.wait_for(late, 10)
        stored = (await second.client.get("/v1/contexts/c")).json()
        kept = await first.client.get(f"/v1/runs/{lost.headers['x-loopwarden-run-id']}")
    assert taken.status_code == 200, taken.text
    assert lost.status_code == 503, lost.text
    assert lost.json()["error"]["code"] == "state_unavailable"
    assert "were not saved" in lost.json()["error"]["message"]
    assert lost.json()["loop"]["stop_reason"] == "state_unavailable"
    assert lost.headers["x-loopwarden-stop-reason"] == "state_unavailable"
    assert lost.headers["x-should-retry"] == "false"  # its tool ran
    # What it made is the client's still: its answer named what ran, and what it said.
    assert lost.json()["saved_ai_messages"] is False
    made = lost.json()["generated_messages"]
    assert [m.get("sender") or m["type"] for m in made] == [
        "human", "tool_call", "tool_response", "ai"
    ]  # fmt: skip
    assert made[-1]["message"] == "Late."
    assert kept.json()["stop_reason"] == "state_unavailable"  # the run is kept all the same
    # One stop reason everywhere: its span and metrics said `completed` (the save came after).
    labels = {"agent": "gated", "model": "scripted"}
    assert first.metric("loopwarden_runs_total", **labels, stop_reason="state_unavailable") == 1
    assert first.metric("loopwarden_runs_total", **labels, stop_reason="completed") == 1
    (agent_span,) = [
        s
        for s in first.spans()
        if s.name.startswith("invoke_agent")
        and s.attributes is not None
        and s.attributes.get("loopwarden.run_id") == lost.headers["x-loopwarden-run-id"]
    ]
    assert agent_span.attributes is not None
    assert agent_span.attributes["loopwarden.stop_reason"] == "state_unavailable"
    said = [m["content"] for m in stored["messages"] if m["role"] in ("user", "assistant")]
    assert said == ["start", "Ready.", "second", "Second."]


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_a_hold_whose_lease_was_lost_saves_nothing_while_another_holds(
    tmp_path: Path, redis_url: str, backend: str
) -> None:
    """The run that lost its lease (its process stalled) finds the context held by the next:
    its save is refused though the next has not saved yet, and the next one's stands."""
    async with two_stores(backend, tmp_path, redis_url) as (first, second, expire):
        await first.save_context(StoredContext("c", agent="a"))
        async with first.hold("c") as late:
            assert late.context is not None
            await expire()
            async with second.hold("c") as next_one:
                assert next_one.context is not None
                late.context.messages = [{"role": "user", "content": "late"}]
                with pytest.raises(StateUnavailable, match="its lock was lost"):
                    await late.end(late.context, [], 60)
                next_one.context.messages = [{"role": "user", "content": "next"}]
                await next_one.end(next_one.context, [Record("run", "next", b"{}")], 60)
        kept = await first.load_context("c")
        assert kept is not None
        assert kept.messages == [{"role": "user", "content": "next"}]
        assert await first.get_record("run", "next") == b"{}"
        async with asyncio.timeout(1), first.hold("c"):  # let go by the next one's end
            pass


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_a_hold_whose_lease_was_lost_does_not_bring_back_a_context_deleted_meanwhile(
    tmp_path: Path, redis_url: str, backend: str
) -> None:
    """The next holder was a `DELETE` (answered 200): the late run's save is refused, and the
    context stays deleted (sqlite wrote it back whole: the lock let go read as its own)."""
    async with two_stores(backend, tmp_path, redis_url) as (first, second, expire):
        await first.save_context(StoredContext("c", agent="a", messages=[{"role": "user"}]))
        async with first.hold("c") as late:
            assert late.context is not None
            await expire()
            async with second.hold("c") as deleting:
                assert await second.delete_context("c")
                await deleting.end(None, [], 60)
            late.context.messages.append({"role": "assistant", "content": "late"})
            with pytest.raises(StateUnavailable):
                await late.end(late.context, [], 60)
        assert await first.load_context("c") is None
        assert await second.load_context("c") is None


async def test_a_wait_for_a_context_cancelled_as_it_takes_the_lock_leaves_it_free(
    backend: StateStore,
) -> None:
    """A client that leaves cancels its wait, maybe as the backend was taking the lock for it:
    the lock is let go then and there, not when its lease ends."""

    async def enter() -> None:
        async with backend.hold("c-cancel"):
            await asyncio.Event().wait()

    for turns in range(8):  # cancelled at each point of the wait, and once held
        waiting = asyncio.create_task(enter())
        for _ in range(turns):
            await asyncio.sleep(0)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        async with asyncio.timeout(5), backend.hold("c-cancel"):  # the lease is 30 s
            pass


async def test_a_wait_for_a_held_context_ends_when_cancelled_at_any_point(
    backend: StateStore,
) -> None:
    async def enter() -> None:
        async with backend.hold("c-busy"):
            raise AssertionError("held by two")

    async with backend.hold("c-busy"):
        for turns in range(12):
            waiting = asyncio.create_task(enter())
            for _ in range(turns):
                await asyncio.sleep(0)
            waiting.cancel()
            done, _ = await asyncio.wait({waiting}, timeout=2)
            assert done, f"cancelled after {turns} turns, it went on waiting"
            assert waiting.cancelled()


async def test_runs_on_one_context_from_two_processes_on_redis_each_see_the_last(
    proxy_for: ProxyFactory, redis_url: str
) -> None:
    """Forty runs at once on one context, half through each of two proxies sharing a redis:
    each run reads the context the run before it saved and saves its turn as it lets go, so
    the context ends with every turn, whole, and no run saw the same history as another."""
    prefix = f"many-{secrets.token_hex(4)}:"
    stores = [RedisStore(redis_url, prefix=prefix), RedisStore(redis_url, prefix=prefix)]

    def ack(body: dict[str, Any]) -> Any:
        return say(f"ack {body['messages'][-1]['content']}")

    try:
        async with proxy_for(store=stores[0]) as one, proxy_for(store=stores[1]) as two:
            one.upstream.script(say("Ready."), keep(ack))
            first = await one.client.post(
                "/chat", json={"context_id": "c", "model": "scripted", "message": "start"}
            )
            assert first.status_code == 200
            replies = await asyncio.gather(
                *(
                    (one, two)[i % 2].client.post(
                        "/chat", json={"context_id": "c", "message": f"m{i}"}
                    )
                    for i in range(40)
                )
            )
            stored = (await one.client.get("/v1/contexts/c")).json()
            seen = [len(body["messages"]) for body in one.upstream.bodies[1:]]
    finally:
        for store in stores:
            await store.close()
    assert [r.status_code for r in replies] == [200] * 40
    said = [m["content"] for m in stored["messages"]]
    assert said[:2] == ["start", "Ready."]
    turns = list(zip(said[2::2], said[3::2], strict=True))
    assert all(reply == f"ack {message}" for message, reply in turns)
    assert sorted(message for message, _ in turns) == sorted(f"m{i}" for i in range(40))
    assert sorted(seen) == [3 + 2 * k for k in range(40)]  # each the history of all before it


@contextlib.asynccontextmanager
async def leased_redis(redis_url: str) -> AsyncIterator[tuple[RedisStore, RedisStore, Any, str]]:
    """Two stores with a 1 s lease (renewed every third of a second), a plain client, and the
    lock key of context 'c'."""
    prefix = f"retake-{secrets.token_hex(4)}:"
    stores = [RedisStore(redis_url, prefix=prefix, lock_lease_s=1.0) for _ in range(2)]
    client = aioredis.Redis.from_url(redis_url)
    try:
        yield stores[0], stores[1], client, f"{prefix}lock:c"
    finally:
        for store in stores:
            await store.close()
        await client.aclose()


async def until_lock(client: Any, lock: str, token: bytes) -> None:
    """Until the lock holds `token` (within 5 s): polled, as another client would see it."""
    for _ in range(500):
        if await client.get(lock) == token:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{lock} never held {token!r}")


async def test_a_redis_lease_that_ran_out_with_no_one_waiting_is_taken_again(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis restarted without its keys, or the holder stalled past its lease with no one
    waiting: the next renewal takes the lock again (the run went on unserialised, so a run
    begun meanwhile on the context raced it), as a sqlite lock row stays its holder's."""
    async with leased_redis(redis_url) as (first, second, client, lock):
        await first.save_context(StoredContext("c", agent="a"))
        async with first.hold("c") as held:
            token = await client.get(lock)
            assert await client.delete(lock) == 1
            await until_lock(client, lock, token)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5), second.hold("c"):
                    raise AssertionError("held by two")
            assert held.context is not None
            held.context.messages = [{"role": "user", "content": "kept"}]
            await held.end(held.context, [], 60)
        async with asyncio.timeout(1), second.hold("c") as after:
            assert after.context is not None
            assert after.context.messages == [{"role": "user", "content": "kept"}]
    assert "the lease on context 'c' had run out; no one had taken it: taken again" in caplog.text


async def test_a_renewal_overtaken_by_the_holds_end_leaves_the_lock_free(redis_url: str) -> None:
    """The hold's last write lets the lock go while a renewal is on its way; the renewal, run
    after it, finds the lock free and takes it again: it is let go as the hold ends, not held
    by a hold that is over until its lease runs out."""
    async with leased_redis(redis_url) as (first, second, client, lock):
        holds = first._holds
        script, entered, go = holds._renew, asyncio.Event(), asyncio.Event()

        async def late_renewal(**kwargs: Any) -> Any:
            entered.set()
            await go.wait()
            return await script(**kwargs)

        holds._renew = late_renewal  # type: ignore[assignment]
        async with first.hold("c") as held:
            token = await client.get(lock)
            await asyncio.wait_for(entered.wait(), 5)
            await held.end(StoredContext("c", agent="a"), [], 60)
            assert await client.exists(lock) == 0
            go.set()
            await until_lock(client, lock, token)  # taken again by the late renewal
        assert await client.exists(lock) == 0
        async with asyncio.timeout(0.5), second.hold("c") as after:
            assert after.context is not None
