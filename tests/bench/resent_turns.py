"""What a turn of a long conversation costs as the conversation grows, through the app in this
process on a state backend, three ways: each turn sending the whole conversation again with the
earlier answers as item references (the AI SDK's way, `store` on), or whole (the openai SDK's
`input += response.output`), or continuing the last turn by `previous_response_id`. For each
mark, the median time of a turn's request over the turns just before it, and what the turn
before the mark asked of the backend: its reads (round trips) and the KB they found.

    python -m tests.bench.resent_turns [--turns 1000] [--bytes 500] [--redis]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry

from proxy.api.app import create_app
from proxy.config import parse_config
from proxy.state.memory import MemoryStore
from proxy.state.redis import RedisStore
from proxy.state.sqlite import SqliteStore
from proxy.state.store import StateStore
from tests.bench.policy_cost import ANSWER, JSON
from tests.servers import redis_server

WAYS = ("references", "whole", "previous_response_id")
WINDOW = 5  # turns timed before each mark


class Counted:
    """A state backend that counts the reads asked of it and the bytes they found."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.reads = 0
        self.read = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def get_record(self, kind: str, key: str) -> bytes | None:
        found = await self.store.get_record(kind, key)
        self.reads += 1
        self.read += len(found or b"")
        return found

    async def get_records(
        self, wanted: Sequence[tuple[str, str]], max_bytes: int | None = None
    ) -> list[bytes | None]:
        found = await self.store.get_records(wanted, max_bytes)
        self.reads += 1
        self.read += sum(len(value or b"") for value in found)
        return found


@contextlib.contextmanager
def backends(redis: bool) -> Iterator[list[tuple[str, StateStore]]]:
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        found: list[tuple[str, StateStore]] = [
            ("memory", MemoryStore()),
            ("sqlite", SqliteStore(Path(folder) / "state.db")),
        ]
        if redis:
            url = stack.enter_context(redis_server(Path(folder)))
            found.append(("redis", RedisStore(url)))
        yield found


@contextlib.asynccontextmanager
async def client_of(store: StateStore) -> AsyncIterator[httpx.AsyncClient]:
    config = {
        "upstreams": {"main": {"base_url": "http://upstream.test/v1", "max_retries": 0}},
        "default_upstream": "main",
        "server": {"max_body_bytes": 64 * 1024 * 1024},
    }

    def answer(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=ANSWER, headers=JSON)

    app = create_app(
        parse_config(config),
        transport=httpx.MockTransport(answer),
        store=store,
        registry=CollectorRegistry(),
    )
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://proxy.test", timeout=120
        ) as client,
    ):
        yield client


async def conversation(
    client: httpx.AsyncClient, counted: Counted, way: str, turns: int, size: int, marks: list[int]
) -> list[tuple[int, float, int, float]]:
    """Per mark: the turn, its median ms over WINDOW turns, the reads and KB of the turn."""
    items: list[dict[str, Any]] = []
    previous: str | None = None
    times: list[float] = []
    rows = []
    for n in range(1, turns + 1):
        message = {"role": "user", "content": f"{n}:" + "x" * size}
        if way == "previous_response_id":
            body: dict[str, Any] = {"model": "scripted", "input": [message]}
            if previous is not None:
                body["previous_response_id"] = previous
        else:
            items.append(message)
            body = {"model": "scripted", "input": items}
        raw = orjson.dumps(body)
        counted.reads = counted.read = 0
        started = time.perf_counter()
        r = await client.post("/v1/responses", content=raw, headers=JSON)
        times.append(time.perf_counter() - started)
        if r.status_code != 200:
            raise SystemExit(f"{way}: turn {n}: {r.status_code} {r.text[:200]}")
        made = r.json()
        previous = made["id"]
        if way == "references":
            items += [{"type": "item_reference", "id": item["id"]} for item in made["output"]]
        elif way == "whole":
            items += made["output"]
        if n in marks:
            ms = 1e3 * statistics.median(times[-WINDOW:])
            rows.append((n, ms, counted.reads, counted.read / 1024))
    return rows


async def measure(
    name: str, store: StateStore, turns: int, size: int
) -> list[tuple[str, str, int, float, int, float]]:
    marks = sorted({mark for mark in (10, 100, 300, turns) if mark <= turns})
    counted = Counted(store)
    rows = []
    async with client_of(counted) as client:  # type: ignore[arg-type]
        for way in WAYS:
            for n, ms, reads, kb in await conversation(client, counted, way, turns, size, marks):
                rows.append((name, way, n, ms, reads, kb))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="resent_turns")
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--bytes", type=int, default=500, help="each user message's text")
    parser.add_argument("--redis", action="store_true", help="also on a redis-server here")
    args = parser.parse_args(argv)
    print(f"{'backend':8} {'way':22} {'turn':>5} {'ms a turn':>9} {'reads':>5} {'KB read':>8}")
    with backends(args.redis) as found:
        for name, store in found:
            for row in asyncio.run(measure(name, store, args.turns, args.bytes)):
                backend, way, n, ms, reads, kb = row
                print(f"{backend:8} {way:22} {n:5} {ms:9.2f} {reads:5} {kb:8.1f}")


if __name__ == "__main__":
    main()
