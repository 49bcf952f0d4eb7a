"""`FaultyUpstream`: an HTTP/1.1 server on 127.0.0.1, written on raw asyncio streams so that it
can do what no well-behaved server library lets it: drip a stream one byte at a time, reset the
connection mid-body, send invalid UTF-8, answer with status 999, stop a stream without `[DONE]`.

    async with FaultyUpstream() as upstream:          # upstream.url is the base URL, with /v1
        upstream.script(drip(b": keep-alive\\n", every_s=0.05), respond(200, completion("Hi")))

Each request takes the next answer of the script; a request that finds none is answered 500
and remembered in `exhausted`. Every answer closes its connection when done (`connection:
close`), so each request is a connection of its own. Requests are recorded in `requests`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import orjson

CRLF = b"\r\n"


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]
Handle = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def listening(handle: Handle, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """Serves each connection to a free port of 127.0.0.1 with `handle`, and yields the port. At
    the end, stops listening and cancels the handlers still at work."""
    handlers: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await handle(reader, writer)
        finally:
            handlers.discard(task)

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=tls)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


class FaultyUpstream:
    """See the module docstring."""

    def __init__(self) -> None:
        self._script: list[Answer] = []
        self.requests: list[Received] = []
        self.exhausted = 0
        self.url = ""
        self._listening = contextlib.AsyncExitStack()

    def script(self, *answers: Answer) -> None:
        self._script = list(answers)

    async def __aenter__(self) -> FaultyUpstream:
        port = await self._listening.enter_async_context(listening(self._serve))
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await self._listening.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            received = await read_request(reader)
            if received is None:
                return
            self.requests.append(received)
            if self._script:
                answer = self._script.pop(0)
            else:
                self.exhausted += 1
                answer = respond(500, {"error": {"message": "script exhausted"}})
            await answer(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the proxy went away: what a fault test expects
        finally:
            if not writer.transport.is_closing():
                writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> Received | None:
    try:
        head = await reader.readuntil(CRLF + CRLF)
    except asyncio.IncompleteReadError:
        return None
    line, *fields = head[:-4].decode("latin-1").split("\r\n")
    method, path, _ = line.split(" ", 2)
    headers = {}
    for field in fields:
        name, _, value = field.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int((await reader.readuntil(CRLF)).split(b";")[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(CRLF) != CRLF:  # trailers, up to the blank line
                    pass
                break
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(chunks)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Received(method, path, headers, body)


# -- answers ----------------------------------------------------------------------------------


def _head(status: int, headers: dict[str, str], reason: str = "Fault") -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers.items())]
    return "\r\n".join([*lines, "connection: close", "", ""]).encode("latin-1")


def respond(
    status: int,
    body: bytes | dict[str, Any] | list[Any],
    *,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
) -> Answer:
    """A whole response with a content-length; a dict or list body is sent as JSON."""
    content = body if isinstance(body, bytes) else orjson.dumps(body)

    async def answer(writer: asyncio.StreamWriter) -> None:
        fields = {"content-type": content_type, "content-length": str(len(content))}
        writer.write(_head(status, {**fields, **(headers or {})}) + content)
        await writer.drain()

    return answer


def stream(
    *pieces: bytes, every_s: float = 0.0, then: str = "end", content_type: str = "text/event-stream"
) -> Answer:
    """A chunked response of `pieces`, `every_s` apart; `then` is how it ends: `end` (the last
    chunk, cleanly), `reset` (the connection is reset) or `hang` (nothing more, ever)."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(_head(200, {"content-type": content_type, "transfer-encoding": "chunked"}))
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            if every_s:
                await asyncio.sleep(every_s)
        if then == "reset":
            await asyncio.sleep(0.05)  # let the pieces reach the proxy first
            reset_now(writer)
        elif then == "hang":
            await asyncio.Event().wait()
        else:
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    return answer


def drip(data: bytes, *, every_s: float, head: bytes = b"") -> Answer:
    """An endless SSE stream: `head`, then `data` again and again, one byte every `every_s`,
    until the proxy hangs up."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(_head(200, {"content-type": "text/event-stream"}) + head)
        await writer.drain()
        while True:
            for byte in data:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(every_s)

    return answer


def raw(data: bytes) -> Answer:
    """`data` as it is, then the connection closed: for an answer that is no HTTP."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()

    return answer


def reset() -> Answer:
    """The connection is reset (TCP RST) once the request is read: no response at all."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        reset_now(writer)

    return answer


def reset_now(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# -- bodies -----------------------------------------------------------------------------------


def completion(
    content: str | None = "Hi.",
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    finish_reason: str = "stop",
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-faulty",
        "object": "chat.completion",
        "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": usage or {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def event(data: dict[str, Any] | bytes) -> bytes:
    """One SSE event; a dict is sent as its JSON."""
    payload = data if isinstance(data, bytes) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


def delta(
    content: str | bytes | None = None,
    *,
    finish_reason: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> bytes:
    """The SSE event of one `chat.completion.chunk`; `content` as bytes goes out as it is,
    inside the JSON string (invalid UTF-8 included)."""
    body: dict[str, Any] = {"role": "assistant"}
    if tool_calls is not None:
        body["tool_calls"] = tool_calls
    marker = "\x00content\x00"
    if content is not None:
        body["content"] = content if isinstance(content, str) else marker
    chunk = {
        "id": "chatcmpl-faulty",
        "object": "chat.completion.chunk",
        "model": "scripted",
        "choices": [{"index": 0, "delta": body, "finish_reason": finish_reason}],
    }
    payload = orjson.dumps(chunk)
    if isinstance(content, bytes):
        payload = payload.replace(orjson.dumps(marker)[1:-1], content)
    return event(payload)


DONE = b"data: [DONE]\n\n"
