"""The floor of a Python relay: a bare ASGI callable (no framework) that passes each request
to the upstream with aiohttp and the answer back, streamed when it is an event stream.

    UPSTREAM=http://127.0.0.1:P uvicorn tests.bench.floor:app --port Q \
        --loop uvloop --http httptools --no-access-log
    UPSTREAM=http://127.0.0.1:P granian --interface asgi tests.bench.floor:app --port Q

With `FLOOR_CLIENT=http1` it relays through Loopwarden's own upstream client
(`proxy.upstream.http1_transport`) instead of aiohttp's: the floor on the client Loopwarden uses.
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp

from proxy.upstream.http1_transport import Http1Transport
from proxy.upstream.transport import Timeouts

UPSTREAM = os.environ.get("UPSTREAM", "http://127.0.0.1:9001").rstrip("/")
HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive"}
Scope = dict[str, Any]
Receive = Any
Send = Any


async def read_body(receive: Receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


class Relay:
    def __init__(self) -> None:
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
        elif scope["type"] == "http":
            await self.relay(scope, receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def client(self) -> aiohttp.ClientSession:
        if self.session is None:  # made in the serving loop (granian runs lifespan elsewhere)
            connector = aiohttp.TCPConnector(limit=1000, keepalive_timeout=60)
            timeout = aiohttp.ClientTimeout(total=600)
            self.session = aiohttp.ClientSession(
                UPSTREAM, connector=connector, auto_decompress=False, timeout=timeout
            )
        return self.session

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        headers = {"content-type": "application/json"}
        for name, value in scope["headers"]:
            if name == b"authorization":
                headers["authorization"] = value.decode()
        method = scope["method"]
        async with self.client().request(method, scope["path"], data=body, headers=headers) as up:
            out = [
                (k.lower().encode(), v.encode())
                for k, v in up.headers.items()
                if k.lower() not in HOP_BY_HOP
            ]
            if up.headers.get("content-type", "").startswith("text/event-stream"):
                await send({"type": "http.response.start", "status": up.status, "headers": out})
                async for chunk in up.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return
            data = await up.read()
            out.append((b"content-length", str(len(data)).encode()))
            await send({"type": "http.response.start", "status": up.status, "headers": out})
            await send({"type": "http.response.body", "body": data})


class Http1Relay(Relay):
    """The same relay over Loopwarden's own HTTP/1.1 client."""

    def __init__(self) -> None:
        super().__init__()
        self.transport: Http1Transport | None = None

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        headers = [("content-type", "application/json")]
        headers += [(k.decode(), v.decode()) for k, v in scope["headers"] if k == b"authorization"]
        if self.transport is None:
            self.transport = Http1Transport()
        url, method = UPSTREAM + scope["path"], scope["method"]
        up = await self.transport.send(method, url, headers, body or None, TIMEOUTS)
        try:
            out = [(k.lower(), v) for k, v in up.raw_headers()]
            out = [(k, v) for k, v in out if k.decode() not in HOP_BY_HOP]
            if (up.header("content-type") or "").startswith("text/event-stream"):
                await send({"type": "http.response.start", "status": up.status, "headers": out})
                async for chunk in up.chunks():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return
            data = b"".join([chunk async for chunk in up.chunks()])
            out.append((b"content-length", str(len(data)).encode()))
            await send({"type": "http.response.start", "status": up.status, "headers": out})
            await send({"type": "http.response.body", "body": data})
        finally:
            await up.aclose()


TIMEOUTS = Timeouts(connect_s=10.0, read_s=600.0)
app = Http1Relay() if os.environ.get("FLOOR_CLIENT") == "http1" else Relay()
