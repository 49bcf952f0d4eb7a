"""How long one large request body holds the event loop: each body is sent straight to the
app's ASGI callable while a 1 ms ticker runs on the same loop, and the longest gap between two
ticks is the stall every other request in the process would have seen (medians of 3, after a
small request has warmed the app up). Beside it, what orjson alone takes to parse that body:
what the stall was before a body's values were counted. The last row is a Responses request
that sends a stored conversation whole again (its messages and items hashed against the
stored response's fingerprint).

    python -m tests.bench.body_stall [--mib N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from statistics import median
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message

from proxy.api.app import create_app
from proxy.api.runtime import settle_runtime
from proxy.config import parse_config
from tests.bench.policy_cost import ANSWER, JSON
from tests.direct_asgi import body_then_stay, post_scope

CONFIG: dict[str, Any] = {
    "upstreams": {"main": {"base_url": "http://upstream.test/v1", "max_retries": 0}},
    "default_upstream": "main",
    "state": {"backend": "memory"},
}
PROSE = "Words, and more words: [some] {bracketed}. " * 150


def repeated(unit: bytes) -> Callable[[int], bytes]:
    """Messages that repeat `unit` to fill `room` bytes."""
    return lambda room: unit * (room // len(unit))


def one_image(room: int) -> bytes:
    """One message whose image, a data URL, fills `room` bytes."""
    url = "data:image/png;base64," + "QUJD" * (room // 4)
    part = {"type": "image_url", "image_url": {"url": url}}
    return orjson.dumps({"role": "user", "content": [part]}) + b","


# The bodies: what fills their messages, given the room.
SHAPES: dict[str, Callable[[int], bytes]] = {
    "empty arrays": repeated(b"[],"),
    "numbers": repeated(b"0,"),
    "small messages": repeated(b'{"role":"user","content":"x"},'),
    "long messages of prose": repeated(orjson.dumps({"role": "user", "content": PROSE}) + b","),
    "one base64 image": one_image,
}


def body(shape: str, size: int) -> bytes:
    head, tail = b'{"model":"scripted","messages":[', b'{"role":"user","content":"?"}]}'
    return head + SHAPES[shape](size - len(head) - len(tail) - 200) + tail


@contextlib.asynccontextmanager
async def ticking() -> AsyncIterator[list[float]]:
    """The gaps between the ticks of a 1 ms ticker on this loop while the block runs, in
    seconds: the longest is the stall every other request saw."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    try:
        yield gaps
    finally:
        done.set()
        await ticker


async def stall_of(
    app: ASGIApp, raw: bytes, path: str = "/v1/chat/completions"
) -> tuple[int, float, float]:
    """The status, the request's wall time and the longest gap between ticks, in seconds."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async with ticking() as gaps:
        started = time.perf_counter()
        await app(post_scope(path), body_then_stay(raw), send)
        wall = time.perf_counter() - started
    return sent[0]["status"], wall, max(gaps)


async def measure(size: int, reps: int = 3) -> list[tuple[str, int, float, float, float]]:
    def answer(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=ANSWER, headers=JSON)

    app = create_app(
        parse_config(CONFIG),
        transport=httpx.MockTransport(answer),
        registry=CollectorRegistry(),
    )
    rows = []
    async with app.router.lifespan_context(app):
        settle_runtime()  # the switch interval the server runs with
        await stall_of(app, body("small messages", 1024))
        for shape in SHAPES:
            raw = body(shape, size)
            parses, walls, stalls, statuses = [], [], [], set()
            for _ in range(reps):
                started = time.perf_counter()
                orjson.loads(raw)
                parses.append(time.perf_counter() - started)
                status, wall, stall = await stall_of(app, raw)
                statuses.add(status)
                walls.append(wall)
                stalls.append(stall)
            (status,) = statuses
            rows.append((shape, status, median(walls), median(stalls), median(parses)))
        rows.append(await resent(app, size, reps))
    return rows


RESENT = "resent conversation"  # /v1/responses: a stored conversation and one more message


async def resent(app: ASGIApp, size: int, reps: int) -> tuple[str, int, float, float, float]:
    """A Responses request that sends a stored response's conversation whole again (its items
    and output, and one more message), `size` bytes of long messages."""
    prose = {"role": "user", "content": PROSE}
    items = [prose] * ((size - 300) // len(orjson.dumps(prose)))
    parses, walls, stalls, statuses = [], [], [], set()
    for _ in range(reps):
        first = orjson.dumps({"model": "scripted", "input": items[:-1]})
        sent = await answered(app, first, "/v1/responses")
        again = [*items[:-1], *orjson.loads(sent)["output"], {"role": "user", "content": "?"}]
        raw = orjson.dumps({"model": "scripted", "input": again})
        started = time.perf_counter()
        orjson.loads(raw)
        parses.append(time.perf_counter() - started)
        status, wall, stall = await stall_of(app, raw, "/v1/responses")
        statuses.add(status)
        walls.append(wall)
        stalls.append(stall)
    (status,) = statuses
    return RESENT, status, median(walls), median(stalls), median(parses)


async def answered(app: ASGIApp, raw: bytes, path: str) -> bytes:
    """The body of the app's answer to `raw`."""
    body: list[bytes] = []

    async def send(message: Message) -> None:
        body.append(message.get("body", b""))

    await app(post_scope(path), body_then_stay(raw), send)
    return b"".join(body)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="body_stall")
    parser.add_argument("--mib", type=float, default=8.0, help="body size (default: the limit)")
    args = parser.parse_args(argv)
    rows = asyncio.run(measure(int(args.mib * 1024 * 1024)))
    head = f"{args.mib:g} MiB body of"
    print(f"{head:30} {'status':>6} {'request ms':>10} {'stall ms':>9} {'orjson ms':>9}")
    for shape, status, wall, stall, parse in rows:
        print(f"{shape:30} {status:6} {wall * 1e3:10.1f} {stall * 1e3:9.1f} {parse * 1e3:9.1f}")


if __name__ == "__main__":
    main()
