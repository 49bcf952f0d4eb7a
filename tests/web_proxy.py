"""A forward web proxy on 127.0.0.1, as a company's egress proxy: `CONNECT` tunnels, and
requests whose line holds a whole http URL relayed to it. It resolves `UPSTREAM_HOST` (a name
only it knows, as an egress proxy knows the outside world's) to 127.0.0.1. It keeps each
connection's first line and `proxy-authorization`, and may refuse every one with an answer of
its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

from tests.faulty_upstream import listening

UPSTREAM_HOST = "upstream.test"  # reserved for testing (RFC 2606): never a real host


def resolved(host: str) -> str:
    return "127.0.0.1" if host == UPSTREAM_HOST else host


class ForwardProxy:
    def __init__(self, refusal: bytes | None = None) -> None:
        self.refusal = refusal
        self.lines: list[str] = []
        self.authorizations: list[str | None] = []
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *fields = head.decode("latin-1").split("\r\n")
            self.lines.append(line)
            found = [f.split(":", 1)[1].strip() for f in fields if ":" in f]
            names = [f.split(":", 1)[0].lower() for f in fields if ":" in f]
            given = dict(zip(names, found, strict=True))
            self.authorizations.append(given.get("proxy-authorization"))
            if self.refusal is not None:
                writer.write(self.refusal)
                await writer.drain()
                return
            method, target, _ = line.split(" ", 2)
            if method == "CONNECT":
                host, _, port = target.rpartition(":")
                up_reader, up_writer = await asyncio.open_connection(
                    resolved(host.strip("[]")), int(port)
                )
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                parts = urlsplit(target)
                address = resolved(parts.hostname or "")
                up_reader, up_writer = await asyncio.open_connection(address, parts.port)
                up_writer.write(head)  # as it came: the upstream reads the path from the URL
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    except ConnectionError:
        pass
    finally:
        sink.close()


@contextlib.asynccontextmanager
async def forward_proxy(refusal: bytes | None = None) -> AsyncIterator[ForwardProxy]:
    proxy = ForwardProxy(refusal)
    async with listening(proxy.handle) as port:
        proxy.url = f"http://127.0.0.1:{port}"
        yield proxy


@contextlib.contextmanager
def forward_proxy_thread() -> Iterator[ForwardProxy]:
    """`forward_proxy` on an event loop of its own thread: for a test that blocks its own (a
    process started and waited for) while the proxy must answer."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    serving = forward_proxy()
    try:
        yield asyncio.run_coroutine_threadsafe(serving.__aenter__(), loop).result(10)
    finally:
        asyncio.run_coroutine_threadsafe(serving.__aexit__(None, None, None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
