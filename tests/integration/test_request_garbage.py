"""A finished request leaves no reference cycle behind: everything it allocated is freed by
reference counting. The serving process relies on it: it runs the cyclic collector rarely
(`GC_THRESHOLDS`), and a request caught in a cycle keeps its whole object graph (its ASGI
`send`, the connection's protocol, the run) alive until a collection that then takes
milliseconds, the tail latency of whoever waits for it."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message

from proxy.api.app import create_app
from proxy.api.event_stream import EventStream
from proxy.config import parse_config
from tests.bench.mock_upstream import MockProtocol
from tests.bench.processes import loopwarden_config
from tests.direct_asgi import body_then_stay, post_scope

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
REQUESTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "chat": (CHAT, {"model": "mock", "messages": HI}, 200),
    "chat stream": (CHAT, {"model": "mock", "messages": HI, "stream": True}, 200),
    "tool loop": (CHAT, {"model": "bench-agent", "messages": HI}, 200),
    "tool loop stream": (CHAT, {"model": "bench-agent", "messages": HI, "stream": True}, 200),
    "responses": ("/v1/responses", {"model": "mock", "input": "hi"}, 200),
    "responses stream": ("/v1/responses", {"model": "mock", "input": "hi", "stream": True}, 200),
    "bad field": (CHAT, {"model": "mock", "messages": "hi"}, 400),
}


@asynccontextmanager
async def proxy(tmp_path: Path, sqlite: bool = False) -> AsyncIterator[ASGIApp]:
    """The app in-process, in front of the fast mock upstream serving in the same loop; state
    in memory, or in sqlite."""
    upstream = await asyncio.get_running_loop().create_server(MockProtocol, "127.0.0.1", 0)
    async with upstream:
        port = upstream.sockets[0].getsockname()[1]
        config = loopwarden_config(f"http://127.0.0.1:{port}/v1", tmp_path, sqlite, {})
        app = create_app(parse_config(config), registry=CollectorRegistry())
        async with app.router.lifespan_context(app):
            yield app


async def call(app: ASGIApp, path: str, body: dict[str, Any]) -> int:
    """One request through the ASGI app, as a server would make it; its status."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await app(post_scope(path), body_then_stay(orjson.dumps(body)), send)
    return int(sent[0]["status"])


@contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize(
    ("kind", "sqlite"), [*((kind, False) for kind in REQUESTS), ("chat", True), ("responses", True)]
)
async def test_a_request_leaves_no_reference_cycle(kind: str, sqlite: bool, tmp_path: Path) -> None:
    path, body, status = REQUESTS[kind]
    async with proxy(tmp_path, sqlite) as app:
        for _ in range(3):  # caches, pools and lazily built things settle first
            assert await call(app, path, body) == status
        with collector_off():
            for _ in range(10):
                assert await call(app, path, body) == status
            cyclic = gc.collect()
    assert cyclic == 0


@pytest.mark.parametrize("ticks", [0, 3])
async def test_a_kept_alive_stream_leaves_no_reference_cycle(ticks: int) -> None:
    """Also when the keep-alive timer has fired and written comments."""
    written: list[Message] = []

    async def send(message: Message) -> None:
        written.append(message)

    with collector_off():
        stream = EventStream(send, {})
        with stream.kept_alive(0.01):
            await asyncio.sleep(0.01 * ticks + 0.005)
        del stream
        await asyncio.sleep(0)  # a comment's task, if any, finishes
        cyclic = gc.collect()
    assert cyclic == 0
    assert sum(m.get("body") == b": keep-alive\n\n" for m in written) >= (1 if ticks else 0)
