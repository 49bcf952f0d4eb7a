"""The port beneath every upstream call: send one HTTP request, get its answer with the body
unread. Production uses an HTTP/1.1 client of its own on httptools (`http1_transport`); any
httpx transport fits too (`httpx_transport`: tests, respx).

A transport does not wrap its library's errors, which would cost a layer per body chunk:
`failure` says what one of them means, and the caller raises its own error for it.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

Headers = Mapping[str, str] | Sequence[tuple[str, str]]
Body = bytes | AsyncIterable[bytes] | None


class Failure(enum.Enum):
    """What a transport error means for the call."""

    UNREACHABLE = "unreachable"  # no connection: refused, no route
    CONNECT_TIMEOUT = "connect_timeout"  # no connection within the connect timeout
    TIMEOUT = "timeout"  # the upstream stayed silent longer than the read timeout
    BROKEN = "broken"  # the connection was closed or reset while in use
    NOT_HTTP = "not_http"  # what came is no HTTP answer: a bad reply, not worth another attempt


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float
    read_s: float  # the longest silence: before the answer starts, or between two reads


class Answer(Protocol):
    """An upstream's answer. The caller closes it (`aclose`, idempotent) however it ends."""

    @property
    def status(self) -> int: ...

    def header(self, name: str) -> str | None:
        """The value of header `name` (any case), the first if it came more than once."""
        ...

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """Every header as it came: names in their case, values raw."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes, as the upstream encoded it (content encodings untouched)."""
        ...

    def keep_alive(self) -> None:
        """The caller read all it needs (a stream's `[DONE]`): what is left of the body is its
        end, which `aclose` may read out of the caller's way to keep the connection."""
        ...

    async def aclose(self) -> None: ...


class AnswerOver:
    """Another answer as it is, for a wrapper that does more as it is closed (`aclose`)."""

    __slots__ = ("_answer", "status")

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self.status = answer.status

    def header(self, name: str) -> str | None:
        return self._answer.header(name)

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return self._answer.raw_headers()

    def chunks(self) -> AsyncIterator[bytes]:
        return self._answer.chunks()  # the inner iterator itself: no layer per chunk

    def keep_alive(self) -> None:
        self._answer.keep_alive()

    async def aclose(self) -> None:
        await self._answer.aclose()


class Transport(Protocol):
    async def send(
        self, method: str, url: str, headers: Headers, body: Body, timeouts: Timeouts
    ) -> Answer:
        """One request, never retried nor redirected; returns whatever status came."""
        ...

    def failure(self, exc: BaseException) -> Failure | None:
        """What `exc`, raised by `send` or while reading an answer, means; None when it is
        not this transport's (the caller's own body failed, say)."""
        ...

    async def aclose(self) -> None: ...
