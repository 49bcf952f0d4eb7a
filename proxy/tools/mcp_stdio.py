"""An MCP server as a child process, spoken to over its stdin and stdout (the MCP stdio
transport: one JSON-RPC message a line), with bounds on each message it sends.

The `mcp` SDK's own stdio client joins every chunk it reads to the part of the line read so
far, so a large message costs time quadratic in its size, on the event loop every request
shares (a 32 MiB tool result: 10 s), and it bounds no message. Here a line is framed in one
pass and may hold at most `max_message_bytes`, and as many JSON values as a request body
(`server.max_body_values`, counted before the line is parsed: 16 MiB of `[],` takes pydantic
4 s). A server that sends a larger one has its session ended (the calls under way fail at
once, the source reconnects), since what follows the cut cannot be read as messages again.
The child's lifecycle is the SDK's: its own process group, its environment the SDK's safe
defaults plus the configured variables, stderr shared with the proxy's, and at the end its
stdin closed, a grace period, then its whole group terminated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio
import mcp_types
from anyio.abc import ByteReceiveStream, ByteSendStream, Process
from mcp.client.stdio import get_default_environment
from mcp.os.posix.utilities import terminate_posix_process_tree
from mcp.shared.message import SessionMessage

from proxy.json_values import holds_over
from proxy.throttled_log import ThrottledWarnings

log = logging.getLogger(__name__)

EXIT_GRACE_S = 2.0  # for the child to exit once its stdin is closed, and again once terminated
EXIT_POLL_S = 0.01
_PIPE_ERRORS = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError)


class MessageTooLarge(Exception):
    """The server sent a line longer than the bound."""


def too_large(limit: int) -> str:
    return f"the server sent a message larger than {limit} bytes (max_message_bytes)"


def too_many_values(limit: int) -> str:
    return (
        f"the server sent a message holding more than {limit} JSON values (server.max_body_values)"
    )


# Messages one stream of a server's may bring: at most MESSAGES_PER_S a second after a burst
# of MESSAGE_BURST (a server sending notifications without end held a core). An HTTP stream
# is one call's (or the session's events); a stdio child's lines are every call's: its
# answers are not counted, and its other lines (notifications, requests, lines that are no
# message) at most STDIO_MESSAGES_PER_S after STDIO_BURST (~5 % of a core, parsed).
MESSAGES_PER_S = 200
MESSAGE_BURST = 1000
STDIO_MESSAGES_PER_S = 1000
STDIO_BURST = 10_000


def too_frequent(per_s: int = MESSAGES_PER_S) -> str:
    return f"the server sent more than {per_s} messages a second"


class MessageRate:
    """Whether a stream's messages come faster than `per_s`, past its `burst`."""

    __slots__ = ("allowed", "at", "burst", "per_s")

    def __init__(self, per_s: int = MESSAGES_PER_S, burst: int = MESSAGE_BURST) -> None:
        self.per_s = per_s
        self.burst = burst
        self.allowed = float(burst)  # messages it may send now
        self.at = time.monotonic()

    def over(self, count: int = 1) -> bool:
        now = time.monotonic()
        self.allowed = min(self.burst, self.allowed + (now - self.at) * self.per_s)
        self.at = now
        self.allowed -= count
        return self.allowed < 0


def _an_answer(read: SessionMessage | Exception) -> bool:
    return isinstance(read, SessionMessage) and isinstance(
        read.message, mcp_types.JSONRPCResponse | mcp_types.JSONRPCError
    )


async def lines(stream: ByteReceiveStream, limit: int) -> AsyncIterator[bytes]:
    """The stream's non-empty lines, without their line feeds; MessageTooLarge as soon as one
    is longer than `limit` bytes. The work is linear in the bytes read, however the pipe cuts
    them: a byte is copied a few times, not once for each chunk that comes after it."""
    pending = bytearray()  # the start of a line whose end has not come yet
    async for chunk in stream:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if len(pending) + end - start > limit:
                raise MessageTooLarge(too_large(limit))
            if pending:
                pending += chunk[start:end]
                line = bytes(pending)
                pending.clear()
            else:
                line = chunk[start:end]
            start = end + 1
            if line.strip():
                yield line
        pending += chunk[start:]
        if len(pending) > limit:
            raise MessageTooLarge(too_large(limit))


class LineNotices:
    """The lines of one server that are no message (it logs to its stdout), told in one line
    each, at most one a second, with a count of those not told (a server writing 200,000 such
    lines made 600,000 lines of log)."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.warnings = ThrottledWarnings(log)

    def tell(self, line: bytes, error: ValueError) -> None:
        why = (str(error).splitlines() or [""])[0][:200]
        self.warnings.warning(
            "MCP server %s sent a line that is not a JSON-RPC message (%r…: %s)",
            self.server,
            line[:80],
            why,
        )

    def close(self) -> None:
        """The session ended: the count of the lines not told yet, if any."""
        self.warnings.close("MCP server %s sent lines that are not messages", self.server)


def message(line: bytes, notices: LineNotices | None = None) -> SessionMessage | Exception:
    """A line as the session takes it: a message, or the error that it is not one. An answer
    the SDK cannot read (nested deeper than it parses, a lone surrogate in a string) whose
    `id` can be read is that request's error, so that its call fails now, not at its timeout."""
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        if notices is not None:
            notices.tell(line, exc)
        request = _answered(line)
        if request is None:
            return exc
        error = mcp_types.ErrorData(
            code=mcp_types.INTERNAL_ERROR, message="the server's answer could not be read"
        )
        return SessionMessage(mcp_types.JSONRPCError(jsonrpc="2.0", id=request, error=error))


def _answered(line: bytes) -> int | str | None:
    """The id of the request `line` answers, if it is a JSON object with one and a `result`
    or an `error`: read by Python's parser, or, for a line nested deeper than it recurses
    (past 1,000 levels), by a scan of its top-level members that skips strings whole."""
    try:
        value = json.loads(line)
    except RecursionError:
        return _scanned(line.decode("utf-8", "replace"))
    except ValueError:
        return None
    if not isinstance(value, dict) or not ("result" in value or "error" in value):
        return None
    return _request_id(value.get("id"))


def _scanned(text: str) -> int | str | None:
    """`_answered` of a line that nests too deep to parse: linear in its length."""
    start = _BLANK.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("{", start):
        return None
    depth, at, last = 0, start, None  # `last`: the string just read at depth 1
    found: dict[str, int] = {}  # top-level member -> where its value begins
    while (mark := _MARKS.search(text, at)) is not None:
        char, at = mark.group(), mark.end()
        if char == '"':
            end = _STRING_END.match(text, at)
            if end is None:
                return None
            if depth == 1:
                last = text[at - 1 : end.end()]
            at = end.end()
        elif char == ":":
            if depth == 1 and last is not None:
                if "\\" not in last:
                    found[last[1:-1]] = at
                else:  # a name written with escapes
                    with contextlib.suppress(ValueError):
                        found[json.loads(last)] = at
                last = None
        elif char in "{[":
            depth += 1
        else:  # "}" or "]"
            depth -= 1
            if depth == 0:
                break
    if not ("result" in found or "error" in found) or "id" not in found:
        return None
    value = _ID.match(text, found["id"])
    if value is None:
        return None
    return _request_id(json.loads(value.group(1)))


def _request_id(value: object) -> int | str | None:
    return value if isinstance(value, int | str) and not isinstance(value, bool) else None


_BLANK = re.compile(r"\s*")
_MARKS = re.compile(r'["{}\[\]:]')
_STRING_END = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # runs, not a char at a time
_ID = re.compile(r'\s*(-?\d+(?=\s*[,}])|"[^"\\]*(?:\\.[^"\\]*)*")', re.DOTALL)


@contextlib.asynccontextmanager
async def stdio_client(
    command: Sequence[str],
    env: Mapping[str, str],
    max_message_bytes: int,
    max_values: int,
    on_end: Callable[[str], None],
) -> AsyncIterator[tuple[Any, Any]]:
    """The session's streams to and from a child running `command`; `on_end` is told why,
    when the server's side ends for a reason of its own (a message over a bound: its bytes, or
    the JSON values it holds, counted before it is parsed)."""
    process = await anyio.open_process(
        list(command),
        env=get_default_environment() | dict(env),
        stderr=None,
        start_new_session=True,
    )
    stdin, stdout = stdin_of(process), stdout_of(process)
    to_session, from_server = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    to_server, from_session = anyio.create_memory_object_stream[SessionMessage](0)
    notices = LineNotices(os.path.basename(command[0]))

    async def relay() -> None:
        rate = MessageRate(STDIO_MESSAGES_PER_S, STDIO_BURST)
        async for line in lines(stdout, max_message_bytes):
            if await holds_over(line, max_values):
                on_end(too_many_values(max_values))
                return
            read = message(line, notices)
            if not _an_answer(read) and rate.over():
                on_end(too_frequent(STDIO_MESSAGES_PER_S))
                return
            await to_session.send(read)

    async def read() -> None:
        async with to_session:
            try:
                await relay()
            except MessageTooLarge as exc:
                on_end(str(exc))
            except _PIPE_ERRORS:
                pass  # the child's end, or ours: the session sees its stream end
        with contextlib.suppress(*_PIPE_ERRORS):  # read on, unread: a child blocked writing
            while True:  # to a full pipe sees its stdin close, and can exit when told to
                await stdout.receive()

    async def write() -> None:
        async with from_session:
            try:
                async for item in from_session:
                    data = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await stdin.send(data.encode() + b"\n")
            except _PIPE_ERRORS:
                await to_session.aclose()  # the child stopped reading: the session is over

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        group.start_soon(write)
        try:
            yield from_server, to_server
        finally:
            with anyio.CancelScope(shield=True):
                from_server.close()  # the reader's next send fails: from then on it drains
                await _stop(process)
                for stream in (from_server, to_server, to_session, from_session):
                    await stream.aclose()
                notices.close()
            group.cancel_scope.cancel()


async def _stop(process: Process) -> None:
    """Closes the child's stdin, gives it EXIT_GRACE_S to exit, then terminates its group (and
    waits as long again for the end to be seen)."""
    with contextlib.suppress(*_PIPE_ERRORS):
        await stdin_of(process).aclose()
    if not await _exited(process):
        await terminate_posix_process_tree(process, EXIT_GRACE_S)
        if not await _exited(process):
            log.warning("MCP server process %d outlived SIGKILL; leaving it", process.pid)
            close_pipes(process)  # but not our ends of its pipes
            return
    with anyio.move_on_after(EXIT_GRACE_S):  # our ends of its pipes
        await process.aclose()


def close_pipes(process: Process) -> None:
    """Our ends of the child's pipes, closed without waiting for it to exit (anyio's
    `Process.aclose` closes them too, then waits). The pipes are the asyncio subprocess
    transport's: anyio's wrappers, closed, would leave them open."""
    transport: asyncio.SubprocessTransport = process._transport  # type: ignore[attr-defined]
    for fd in (0, 1, 2):
        if (pipe := transport.get_pipe_transport(fd)) is not None:
            pipe.close()


async def _exited(process: Process) -> bool:
    """Whether the child exits within EXIT_GRACE_S. Its return code is polled: waiting for the
    process would wait for its pipes too, which a grandchild may hold open."""
    with anyio.move_on_after(EXIT_GRACE_S):
        while process.returncode is None:  # noqa: ASYNC110 (no event says it)
            await anyio.sleep(EXIT_POLL_S)
        return True
    return False


def stdin_of(process: Process) -> ByteSendStream:
    assert process.stdin is not None
    return process.stdin


def stdout_of(process: Process) -> ByteReceiveStream:
    assert process.stdout is not None
    return process.stdout
