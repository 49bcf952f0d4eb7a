"""An MCP server for the tests, written with the `mcp` package's server API.

    python tests/mcp_server.py stdio [wordy] [dotted] [extra] [slow-relist]  # the proxy's child
    python tests/mcp_server.py http PORT [legacy] [gzip | gzip-always] [outside] [cutting]
                                                   [patterned] [hostile [retry-0]
                                                   [mute-cancels]]
                                                   # streamable HTTP on 127.0.0.1:PORT/mcp

`legacy` refuses the 2026 `server/discover` probe, so that clients fall back to the handshake
era: sessions with an `mcp-session-id` and `notifications/tools/list_changed` on the session.
Its tools succeed, fail, sleep, return structured content, die mid-call, and change the tool
list. `wordy` adds a tool whose description is 100 KiB long (its tool list is one long
message); `dotted` adds `x.y` and `x_y`; `extra` lists from the start the tool `grow` adds
(saying it is this server's, `extra of the other: ...`); `slow-relist` answers every tool list
after the first in 5 s. `gzip` compresses answers of 500 bytes
and more for clients that accept it (Starlette's middleware), `gzip-always` for every client.
`outside` answers requests for `upstream.test` too (a name an egress proxy resolves to it,
tests/web_proxy.py) where the SDK's guard against DNS rebinding answers only those for loopback
names. `cutting` adds a tool `cut` whose call's answer (an event stream) is cut off after its
first bytes, as a balancer ending a long call would. `patterned` adds a tool `word` whose
output schema has a pattern that a backtracking matcher takes exponential time to search its
result with (the server's own check, Rust's `regex`, is linear). `hostile` adds tools whose
calls the server answers as no server should: `endless` with an event stream of notifications
that never ends, whatever the client says (one every `every_s`, 0.02 s unless given); `weird`
with 5,000 content parts of no known type; `loop` with a redirect to itself; `held` in JSON,
its headers and all, after `seconds` (10 unless given); `resumable` with an event stream that
ends after its first event's id, to be resumed (a GET naming it) as one that never ends; and
`tally` to
tell what it saw (`streams`: endless streams still open, `posts`: calls of `loop` received,
`gets`: event streams asked for). With `retry-0`, the event stream asks to be opened again at
once and ends; with `mute-cancels`, a `notifications/cancelled` is never acknowledged.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, TypedDict

import anyio
import uvicorn
from mcp.server import MCPServer
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.types import Image
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_REQUEST, METHOD_NOT_FOUND
from pydantic import BaseModel, Field
from starlette.middleware.gzip import GZipMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

OUTSIDE_HOST = "upstream.test"  # tests/web_proxy.py's UPSTREAM_HOST (run as a script: no package)


class Forecast(TypedDict):
    city: str
    celsius: float


class Numbers(TypedDict):
    values: list[int]


class Word(BaseModel):
    word: str = Field(pattern=r"(a+)+c|b")  # 'aaa…ab': found at its end, after 2^n tries


def build(wordy: bool = False, dotted: bool = False, extra: bool = False) -> MCPServer:
    server = MCPServer("loopwarden-tests", log_level="WARNING")
    if wordy:
        server.add_tool(lambda: "", name="wordy", description="x" * 100 * 1024)
    if extra:

        def other_extra(note: str) -> str:
            """This server's own `extra`."""
            return f"extra of the other: {note}"

        server.add_tool(other_extra, name="extra", structured_output=False)
    if dotted:  # names no model API takes, one of them made into the other's
        server.add_tool(lambda: "dotted", name="x.y", description="x.y", structured_output=False)
        server.add_tool(lambda: "plain", name="x_y", description="x_y", structured_output=False)

    @server.tool(structured_output=False)
    def echo(text: str) -> str:
        """Says the text back."""
        return f"echo: {text}"

    @server.tool()
    def forecast(city: str) -> Forecast:
        """The forecast of a city (structured content)."""
        return {"city": city, "celsius": 21.5}

    @server.tool()
    def numbers(count: int) -> Numbers:
        """`count` zeros (structured content: a JSON value each)."""
        return {"values": [0] * count}

    @server.tool()
    def huge() -> Numbers:
        """A number past 64 bits, which JSON holds and orjson does not write."""
        return {"values": [2**70]}

    @server.tool(structured_output=False)
    def large(kib: int) -> str:
        """A text of `kib` KiB, in one message."""
        return "x" * (kib * 1024)

    @server.tool(structured_output=False)
    def fail(message: str) -> str:
        """Always fails with the message (isError)."""
        raise ToolError(message)

    @server.tool(structured_output=False)
    async def nap(seconds: float) -> str:
        """Answers after `seconds`."""
        import anyio

        await anyio.sleep(seconds)
        return f"slept {seconds:g}s"

    @server.tool(structured_output=False)
    def pid() -> str:
        """The server's process id."""
        return str(os.getpid())

    @server.tool(structured_output=False)
    def die() -> str:
        """The server exits in the middle of the call."""
        os._exit(3)

    @server.tool()
    def deep(levels: int) -> dict[str, Any]:
        """Structured content nested `levels` deep: past what the client's parser reads at 250
        (the server writes it all the same)."""
        value: dict[str, Any] = {}
        for _ in range(levels):
            value = {"in": value}
        return value

    @server.tool(structured_output=False)
    def refuse(message: str = "quota exceeded for this tool", code: int = INVALID_REQUEST) -> str:
        """Answers the call with a JSON-RPC error of its own (not a tool error)."""
        raise MCPError(code=code, message=message)

    @server.tool(structured_output=False)
    def picture() -> Image:
        """An image, which the proxy does not show the model."""
        return Image(data=b"\x89PNG\r\n", format="png")

    @server.tool(structured_output=False)
    def trace_context(ctx: Context) -> str:
        """The `traceparent` of this call's `_meta`."""
        meta: Any = ctx.request_context.meta
        if meta is not None and not isinstance(meta, dict):
            meta = meta.model_dump(by_alias=True)
        return str((meta or {}).get("traceparent"))

    @server.tool(structured_output=False)
    def authorization(ctx: Context) -> str:
        """The Authorization header of this call (streamable HTTP)."""
        request: Any = ctx.request_context.request  # the HTTP request
        return str(request.headers.get("authorization") if request is not None else None)

    @server.tool(structured_output=False)
    async def grow(ctx: Context, kib: int = 0) -> str:
        """Adds the tool `extra` (its description `kib` KiB longer) and says that the tool list
        changed."""

        def extra(note: str) -> str:
            """A tool that was not there at first."""
            return f"extra: {note}"

        if "extra" not in {t.name for t in await server.list_tools()}:
            description = (extra.__doc__ or "") + "x" * kib * 1024
            server.add_tool(extra, name="extra", description=description, structured_output=False)
        await ctx.notify_tools_changed()  # 2026 era: on the listen stream
        with contextlib.suppress(Exception):  # handshake era: on the session
            await ctx.session.send_tool_list_changed()
        return "grown"

    return server


async def refuse_discover(
    ctx: ServerRequestContext[Any, Any], call_next: CallNext
) -> HandlerResult:
    if ctx.method == "server/discover":
        raise MCPError(code=METHOD_NOT_FOUND, message="Method not found")
    return await call_next(ctx)


async def slow_relist(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
    """Every tool list after the first takes RELIST_S."""
    if ctx.method == "tools/list":
        if LISTED:
            await anyio.sleep(RELIST_S)
        LISTED.append(True)
    return await call_next(ctx)


LISTED: list[bool] = []
RELIST_S = 5.0


def main(argv: list[str]) -> None:
    options = argv[1:]
    server = build(wordy="wordy" in options, dotted="dotted" in options, extra="extra" in options)
    if "slow-relist" in options:
        server.middleware.append(slow_relist)
    if argv[0] == "stdio":
        server.run("stdio")
        return
    if "legacy" in argv[2:]:
        server.middleware.append(refuse_discover)
    guard = None
    if "outside" in argv[2:]:
        hosts = ["127.0.0.1:*", "localhost:*", f"{OUTSIDE_HOST}:*"]
        guard = TransportSecuritySettings(allowed_hosts=hosts, allowed_origins=[])
    app: ASGIApp = server.streamable_http_app(transport_security=guard)
    if "patterned" in argv[2:]:

        def word(length: int) -> Word:
            """A word of `length` a's and a b."""
            return Word(word="a" * length + "b")

        server.add_tool(word, structured_output=True)
    if "hostile" in argv[2:]:
        for name in HOSTILE:
            server.add_tool(lambda: "never", name=name, description="Answered as no server should.")
        server.add_tool(tally)
        app = hostile(app, retry_0="retry-0" in argv[2:], mute_cancels="mute-cancels" in argv[2:])
    if "cutting" in argv[2:]:
        server.add_tool(lambda: "never", name="cut", description="Its answer is cut off.")
        app = cutting_calls(app)
    if "gzip" in argv[2:]:
        app = GZipMiddleware(app)
    if "gzip-always" in argv[2:]:
        app = accepting_gzip(GZipMiddleware(app))
    # (its streams that never end are cut at once when it is stopped)
    uvicorn.run(
        app, host="127.0.0.1", port=int(argv[1]), log_level="warning", timeout_graceful_shutdown=1
    )


def cutting_calls(app: ASGIApp) -> ASGIApp:
    """`app`, but a `tools/call` of `cut` starts an event stream and drops the connection."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        body = await _body(receive)
        if b'"name":"cut"' in body.replace(b" ", b""):
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b": begun\n\n", "more_body": True})
            raise ConnectionResetError("the connection dropped mid-answer")
        await app(scope, _replaying(body, receive), send)

    return wrapped


async def _body(receive: Receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    return body


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app, after a wrapper read the request's `body`: that body first."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


TALLY = {"streams": 0, "posts": 0, "gets": 0}


def tally(what: str) -> str:
    """What the server saw: `streams`, `posts` or `gets`."""
    return str(TALLY[what])


def hostile(app: ASGIApp, retry_0: bool, mute_cancels: bool) -> ASGIApp:
    """`app`, with the answers `hostile` (and `retry-0`, `mute-cancels`) make."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if scope["method"] == "GET":
            TALLY["gets"] += 1
            resumed = dict(scope["headers"]).get(b"last-event-id", b"")
            if resumed.startswith(b"resume-"):  # `resumable`'s answer, resumed: without end
                await _endless({}, None, scope, receive, send)
                return
            if retry_0:
                headers = [(b"content-type", b"text/event-stream")]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": b"retry: 0\n\n"})
                return
        if scope["method"] != "POST":
            await app(scope, receive, send)
            return
        body = await _body(receive)
        request = json.loads(body)
        params = request.get("params") or {}
        if request.get("method") == "tools/call" and params.get("name") in HOSTILE:
            arguments = params.get("arguments") or {}
            await HOSTILE[params["name"]](arguments, request["id"], scope, receive, send)
            return
        if mute_cancels and request.get("method") == "notifications/cancelled":
            await anyio.sleep_forever()
        await app(scope, _replaying(body, receive), send)

    return wrapped


async def _endless(
    arguments: Any, request_id: Any, scope: Scope, receive: Receive, send: Send
) -> None:
    headers = [(b"content-type", b"text/event-stream"), *_session(scope)]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    note = {"jsonrpc": "2.0", "method": "notifications/message",
            "params": {"level": "info", "data": "still going"}}  # fmt: skip
    event = b"event: message\ndata: " + json.dumps(note).encode() + b"\n\n"
    TALLY["streams"] += 1
    try:
        async with anyio.create_task_group() as streaming:

            async def until_closed() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                streaming.cancel_scope.cancel()

            streaming.start_soon(until_closed)
            while True:
                await send({"type": "http.response.body", "body": event, "more_body": True})
                await anyio.sleep(arguments.get("every_s", 0.02))
    finally:  # the client closed it
        TALLY["streams"] -= 1


async def _weird(
    arguments: Any, request_id: Any, scope: Scope, receive: Receive, send: Send
) -> None:
    result = {"content": [{"type": "weird", "n": n} for n in range(5000)]}
    await _json_result(request_id, result, scope, send)


async def _loop(
    arguments: Any, request_id: Any, scope: Scope, receive: Receive, send: Send
) -> None:
    TALLY["posts"] += 1
    headers = [(b"location", scope["path"].encode()), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 307, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _json_result(request_id: Any, result: Any, scope: Scope, send: Send) -> None:
    """A call's `result`, answered as JSON in the call's session."""
    body = json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}).encode()
    headers = [(b"content-type", b"application/json"), *_session(scope)]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _session(scope: Scope) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in scope["headers"] if k == b"mcp-session-id"]


async def _held(
    arguments: Any, request_id: Any, scope: Scope, receive: Receive, send: Send
) -> None:
    await anyio.sleep(arguments.get("seconds", 10))
    await _json_result(request_id, {"content": [{"type": "text", "text": "held"}]}, scope, send)


async def _resumable(
    arguments: Any, request_id: Any, scope: Scope, receive: Receive, send: Send
) -> None:
    headers = [(b"content-type", b"text/event-stream"), *_session(scope)]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"id: resume-0\nretry: 100\ndata: \n\n"})


HOSTILE = {
    "endless": _endless,
    "weird": _weird,
    "loop": _loop,
    "held": _held,
    "resumable": _resumable,
}


def accepting_gzip(app: ASGIApp) -> ASGIApp:
    """`app` as if every request said `accept-encoding: gzip`."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = [(k, v) for k, v in scope["headers"] if k != b"accept-encoding"]
            scope = {**scope, "headers": [*headers, (b"accept-encoding", b"gzip")]}
        await app(scope, receive, send)

    return wrapped


if __name__ == "__main__":
    main(sys.argv[1:])
