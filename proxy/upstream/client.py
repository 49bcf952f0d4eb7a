"""An OpenAI-compatible upstream as the engine's `ChatModel`: JSON or SSE, with retries, all
of one step's call within `step_timeout_s` (and the caller's deadline); its model list; and the
one-attempt `send` that the relay shares."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from proxy.deadline import Deadline
from proxy.engine.values import DeltaSink, ModelReply, ModelRequest
from proxy.errors import (
    CallDeadlineReached,
    ClientDisconnected,
    UpstreamBadReply,
    UpstreamFailure,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.json_values import holds_over
from proxy.parse_turns import parse_turn
from proxy.throttled_log import ThrottledWarnings, described
from proxy.upstream.error_body import ERROR_BODY_LIMIT, status_failure
from proxy.upstream.reply import ReplyLimits, stream_head
from proxy.upstream.retry import RETRY_STATUSES, Retry
from proxy.upstream.stream import ReplyReader
from proxy.upstream.transport import (
    Answer,
    AnswerOver,
    Body,
    Failure,
    Headers,
    Timeouts,
    Transport,
)

# `GET /models` is asked while a client waits for its model list: 5 s per read, 10 s in all.
MODELS_TIMEOUT = Timeouts(5.0, 5.0)
MODELS_TOTAL_S = 10.0
# Client fields that only make sense when tools are offered.
TOOL_FIELDS = ("tool_choice", "parallel_tool_calls")

AttemptHook = Callable[[str, str], None]  # (upstream name, status class)
HeadersHook = Callable[[dict[str, str]], None]  # adds trace context to an upstream request

log = logging.getLogger(__name__)


def status_class(status: int) -> str:
    return f"{status // 100}xx"


@dataclass(slots=True)
class Upstream:
    """One configured upstream. `with_key` gives a copy that sends another API key.

    `timeout_s` is the longest the upstream may stay silent (to start its answer, or between two
    reads of it); `step_timeout_s` the most one step's call may take in all, however slowly the
    bytes trickle in: every attempt, the waits between them, the whole body or stream."""

    name: str
    base_url: str
    # The transport itself: the client's cookie, auth and redirect layers cost a quarter of
    # the relay's CPU and do nothing for an API call.
    transport: Transport
    api_key: str | None = None
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    step_timeout_s: float = 600.0
    max_retries: int = 2
    max_retry_wait_s: float = 30.0
    limits: ReplyLimits = field(default_factory=ReplyLimits)
    on_attempt: AttemptHook | None = None
    inject_headers: HeadersHook | None = None
    retry_base_s: float = 0.5
    # The failures it meets, told to the operator (shared by its copies for other keys).
    warnings: ThrottledWarnings = field(
        default_factory=lambda: ThrottledWarnings(log), compare=False, repr=False
    )
    _url: str = field(init=False)
    _timeouts: Timeouts = field(init=False)
    _reader: ReplyReader = field(init=False)

    def __post_init__(self) -> None:
        self._url = f"{self.base_url}/chat/completions"
        self._timeouts = Timeouts(self.connect_timeout_s, self.timeout_s)
        self._reader = ReplyReader(self.name, self.limits, [self.api_key])

    def with_key(self, api_key: str | None) -> Upstream:
        return replace(self, api_key=api_key)

    def body(self, request: ModelRequest) -> dict[str, Any]:
        body = dict(request.params)
        body["model"] = request.model
        body["messages"] = request.messages
        if request.tools:
            body["tools"] = request.tools
            if request.tool_choice is not None:
                body["tool_choice"] = request.tool_choice
        else:
            for key in TOOL_FIELDS:
                body.pop(key, None)
        cap = request.max_completion_tokens
        if cap is not None:  # in the client's own field: OpenAI refuses the two at once
            if isinstance(body.get("max_tokens"), int):
                body["max_tokens"] = min(body["max_tokens"], cap)
            else:
                body["max_completion_tokens"] = cap
        if request.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        else:
            body.pop("stream", None)
            body.pop("stream_options", None)
        return body

    def request_headers(self, content_type: str | None = "application/json") -> dict[str, str]:
        """The headers every request to this upstream carries: `content_type` when given, an
        unencoded body asked for, this upstream's key, and the trace context when the hook is set.
        """
        headers = {"content-type": content_type} if content_type else {}
        headers["accept-encoding"] = "identity"
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        if self.inject_headers is not None:
            self.inject_headers(headers)
        return headers

    async def complete(
        self, request: ModelRequest, on_delta: DeltaSink | None, *, deadline: float | None = None
    ) -> ModelReply:
        """One step's call, retried as the config allows, given up at `step_timeout_s` or at
        `deadline` (a `time.monotonic()` instant), whichever comes first.

        Raises UpstreamFailure: UpstreamTimeout when `step_timeout_s` ran out, and its subclass
        CallDeadlineReached when `deadline` did."""
        now = time.monotonic()
        own = now + self.step_timeout_s
        theirs = deadline is not None and deadline < own
        end = deadline if theirs and deadline is not None else own
        # A client slow to take the text holds the deadline (see `_ClientTimeExcluded`), for
        # as long as the upstream may take a step: then it has gone, to all intents.
        timer = Deadline(asyncio.get_running_loop().time() + (end - now), self.step_timeout_s)
        call = _Call(end, timer)
        if on_delta is not None and not theirs:
            on_delta = _ClientTimeExcluded(on_delta, timer)
        try:
            return await self._attempts(request, on_delta, call)
        except asyncio.CancelledError:
            if not timer.disarm():
                raise
            if timer.held_out:
                raise ClientDisconnected(
                    f"the client took no text for {self.step_timeout_s:g} s"
                ) from None
            if call.waiting:
                self._count("timeout")  # this attempt never got its answer
            if theirs:
                raise CallDeadlineReached(
                    f"the deadline of this call passed while upstream {self.name} was answering"
                ) from None
            raise UpstreamTimeout(
                f"upstream {self.name} did not finish within {self.step_timeout_s:g} s"
            ) from None
        finally:
            timer.disarm()

    async def _attempts(
        self, request: ModelRequest, on_delta: DeltaSink | None, call: _Call
    ) -> ModelReply:
        content = orjson.dumps(self.body(request))
        attempt = 0
        while True:
            try:
                if request.stream:
                    return await self._stream(content, on_delta, call)
                return await self._json(content, call)
            except Retry as retry:
                if attempt >= self.max_retries:
                    raise retry.error from None
                attempt += 1
                delay = retry.delay_s(attempt, self.retry_base_s, self.max_retry_wait_s)
                if time.monotonic() + delay >= call.end:
                    raise retry.error from None  # no time left to try again
                await asyncio.sleep(delay)

    async def send(
        self,
        method: str,
        url: str,
        headers: Headers,
        content: Body = None,
        *,
        timeouts: Timeouts | None = None,
        caller_error: Callable[[], BaseException | None] | None = None,
    ) -> Answer:
        """One attempt, never retried, counted through `on_attempt` by its outcome. Returns the
        answer whatever its status, its body unread: the caller closes it. `timeouts` replace
        this upstream's.

        Raises UpstreamUnavailable when the connection failed (refused, reset, closed) or timed
        out connecting, and UpstreamTimeout when the response did not start in time.
        `caller_error` gives what the caller's `content` stream raised, if anything: the
        transport reports that as a connection failure, but the upstream is not at fault, so it
        is raised as it is and not counted.
        """
        try:
            answer = await self.transport.send(
                method, url, headers, content, self._timeouts if timeouts is None else timeouts
            )
        except Exception as exc:
            failed = caller_error() if caller_error is not None else None
            if failed is not None:
                raise failed from None
            failure = self.transport.failure(exc)
            if failure is None:
                raise
            self.warnings.warning("upstream %s failed: %s", self.name, _cause(exc))
            if failure is Failure.TIMEOUT:
                self._count("timeout")
                raise UpstreamTimeout(f"upstream {self.name} timed out") from None
            self._count("timeout" if failure is Failure.CONNECT_TIMEOUT else "connect_error")
            if failure is Failure.NOT_HTTP:
                raise self._not_http(exc) from None
            raise UpstreamUnavailable(
                f"upstream {self.name} unreachable: {_cause_name(exc)}"
            ) from None
        if 200 <= answer.status < 300:
            return _Counted(answer, self._count)  # counted by how its body ends
        self._count(status_class(answer.status))
        if answer.status >= 500 or answer.status == 429:  # its fault, or its limits: not a client's
            self.warnings.warning("upstream %s answered HTTP %d", self.name, answer.status)
        return answer

    async def _send(self, content: bytes, call: _Call) -> Answer:
        call.waiting = True  # until `send` counted the attempt, which it does unless cancelled
        try:
            response = await self.send("POST", self._url, self.request_headers(), content)
        except Exception as exc:
            call.waiting = False
            if isinstance(exc, UpstreamUnavailable):
                raise Retry(exc) from None  # no answer came: worth another attempt
            raise
        call.waiting = False
        if isinstance(response, _Counted):
            response.deadline = call.timer
        if not 200 <= response.status < 300:
            error = await self.status_error(response)
            if response.status in RETRY_STATUSES:
                raise Retry(error, response.header("retry-after"))
            raise error
        return response

    async def status_error(self, response: Answer) -> UpstreamFailure:
        """An answer with a status other than 2xx as the error that relays it (see
        `error_body.status_failure`), its body read up to ERROR_BODY_LIMIT bytes within
        `timeout_s`; closes the response."""
        body = b""
        with contextlib.suppress(UpstreamFailure, TimeoutError):
            async with asyncio.timeout(self.timeout_s), self.reading(response):
                async for chunk in response.chunks():
                    body += chunk
                    if len(body) > ERROR_BODY_LIMIT:
                        body = body[:ERROR_BODY_LIMIT]  # cut: it reads as no JSON, not shown
                        break
        return status_failure(
            self.name,
            response.status,
            body,
            response.header("content-type"),
            [self.api_key],
            response.raw_headers(),
        )

    async def models(self) -> list[dict[str, Any]]:
        """The models this upstream lists: the entries of `GET {base_url}/models`'s `data` that are
        objects, asked with this upstream's own key, one attempt with a 5 s timeout per read and
        10 s in all.

        Raises UpstreamUnavailable, UpstreamTimeout or UpstreamBadReply when the upstream cannot
        be reached, is too slow, or answers with something other than a JSON object with a
        `data` list, and UpstreamStatusError for any other status but 200.
        """
        try:
            async with asyncio.timeout(MODELS_TOTAL_S):
                response = await self.send(
                    "GET",
                    f"{self.base_url}/models",
                    self.request_headers(content_type=None),
                    timeouts=MODELS_TIMEOUT,
                )
                if response.status != 200:
                    raise await self.status_error(response)
                data = (await self._read_object(response)).get("data")
        except TimeoutError:
            raise UpstreamTimeout(f"upstream {self.name} timed out listing its models") from None
        if not isinstance(data, list):
            raise UpstreamBadReply(f"upstream {self.name} sent a model list without `data`")
        return [entry for entry in data if isinstance(entry, dict)]

    async def _json(self, content: bytes, call: _Call) -> ModelReply:
        return self._reader.reply(await self._read_object(await self._send(content, call)))

    @contextlib.asynccontextmanager
    async def reading(self, response: Answer) -> AsyncIterator[None]:
        """Reads of `response`'s body inside fail as UpstreamTimeout or UpstreamUnavailable;
        closes the response at the end."""
        try:
            yield
        except Exception as exc:
            failure = self.transport.failure(exc)
            if failure is None:
                raise
            if isinstance(response, _Counted):
                response.cut_by = "timeout" if failure is Failure.TIMEOUT else "connect_error"
            self.warnings.warning("upstream %s failed mid-answer: %s", self.name, _cause(exc))
            if failure is Failure.TIMEOUT:
                raise UpstreamTimeout(f"upstream {self.name} timed out") from None
            if failure is Failure.NOT_HTTP:
                raise self._not_http(exc) from None
            raise UpstreamUnavailable(
                f"upstream {self.name} failed mid-answer: the connection was closed or reset "
                f"({_cause_name(exc)})"
            ) from None
        finally:
            await response.aclose()

    async def _read_object(self, response: Answer) -> dict[str, Any]:
        async with self.reading(response):
            length = response.header("content-length")
            raw = await self._reader.body(response.chunks(), length)
        async with parse_turn(len(raw)):
            if await holds_over(raw, self.limits.max_values):
                raise UpstreamBadReply(
                    f"upstream {self.name} sent a body of more than {self.limits.max_values} "
                    "JSON values (max_response_values)"
                )
            return self._reader.json_object(raw)

    async def _stream(self, content: bytes, on_delta: DeltaSink | None, call: _Call) -> ModelReply:
        started = time.monotonic()
        response = await self._send(content, call)
        if "json" in (response.header("content-type") or ""):
            # An upstream that ignores `stream` answers with one body: relay it as one delta.
            body = await self._read_object(response)
            reply = self._reader.reply(body)
            if on_delta is not None:
                await on_delta.begin(stream_head(body), reply.text)
            reply.raw = None
            return reply
        async with self.reading(response):
            reply = await self._reader.stream(response.chunks(), on_delta, started)
            response.keep_alive()  # a whole reply: what may be left is the body's end
            return reply

    def _not_http(self, exc: BaseException) -> UpstreamBadReply:
        """A bad reply, as a malformed body is: its status line, head or framing is no HTTP."""
        return UpstreamBadReply(f"upstream {self.name} sent what is not HTTP ({exc})")

    def _count(self, outcome: str) -> None:
        if self.on_attempt is not None:
            self.on_attempt(self.name, outcome)


@dataclass(slots=True)
class _Call:
    """One step's call: when it must end (`end`, and `timer`, which cancels it then), and whether
    an attempt is waiting for its answer."""

    end: float
    timer: Deadline
    waiting: bool = False


class _Counted(AnswerOver):
    """A 2xx answer, counted as an attempt when it is closed: as `2xx`, or as what cut its
    body short (`cut_by`: `timeout`, `connect_error`, also when its step's `deadline` ran out
    while it was read, but not when a client slow to take the text held it out), which its
    status alone would hide."""

    __slots__ = ("_count", "cut_by", "deadline")

    def __init__(self, answer: Answer, count: Callable[[str], None]) -> None:
        super().__init__(answer)
        self._count: Callable[[str], None] | None = count
        self.cut_by: str | None = None
        self.deadline: Deadline | None = None

    async def aclose(self) -> None:
        count, self._count = self._count, None
        if count is not None:
            deadline = self.deadline
            if self.cut_by is None and deadline is not None and deadline.expired:
                # The step's time ran out mid-answer (not the client's slowness, which held it).
                self.cut_by = None if deadline.held_out else "timeout"
            count(self.cut_by or status_class(self.status))
        await self._answer.aclose()


class _ClientTimeExcluded:
    """A sink, the time it takes (a client slow to read, whose socket is full) not counted
    toward the call's own deadline: `step_timeout_s` is the upstream's time, and a client's
    slowness is no upstream's failure. (A deadline of the caller's, the run's time budget, is
    not held.)"""

    __slots__ = ("sink", "timer")

    def __init__(self, sink: DeltaSink, timer: Deadline) -> None:
        self.sink = sink
        self.timer = timer

    async def begin(self, head: Mapping[str, str], text: str) -> None:
        self.timer.hold()
        try:
            await self.sink.begin(head, text)
        finally:
            self.timer.release()

    async def __call__(self, text: str) -> None:
        self.timer.hold()
        try:
            await self.sink(text)
        finally:
            self.timer.release()


def _cause(exc: BaseException) -> str:
    """What the error beneath a transport's error says, for the operator's log (the client
    reads its name alone: its message may name the upstream's address)."""
    return described(exc.__cause__ if exc.__cause__ is not None else exc)


def _cause_name(exc: BaseException) -> str:
    """The name of the error beneath a transport's error, which says what happened."""
    cause = exc.__cause__
    return type(cause if cause is not None else exc).__name__
