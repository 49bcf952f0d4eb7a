"""An OpenAI-compatible upstream as the engine's `ChatModel`: JSON or SSE, with retries; its
model list; and the one-attempt `send` that the relay shares."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import orjson

from proxy.engine.values import DeltaSink, ModelReply, ModelRequest
from proxy.errors import UpstreamStatusError, UpstreamTimeout, UpstreamUnavailable
from proxy.upstream.reply import ChunkAccumulator, reply_from_body
from proxy.upstream.sse import SSEDecoder

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 30.0
# `GET /models` is asked while a client waits for its model list.
MODELS_TIMEOUT = httpx.Timeout(5.0).as_dict()
# Client fields that only make sense when tools are offered.
TOOL_FIELDS = ("tool_choice", "parallel_tool_calls")

AttemptHook = Callable[[str, str], None]  # (upstream name, status class)
HeadersHook = Callable[[dict[str, str]], None]  # adds trace context to an upstream request


def status_class(status: int) -> str:
    return f"{status // 100}xx"


@dataclass(slots=True)
class Upstream:
    """One configured upstream. `with_key` gives a copy that sends another API key."""

    name: str
    base_url: str
    # The transport itself: the client's cookie, auth and redirect layers cost a quarter of
    # the relay's CPU and do nothing for an API call.
    transport: httpx.AsyncBaseTransport
    api_key: str | None = None
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_retries: int = 2
    on_attempt: AttemptHook | None = None
    inject_headers: HeadersHook | None = None
    retry_base_s: float = 0.5
    _url: httpx.URL = field(init=False)  # parsed once: parsing a URL string costs a request 5%
    _timeout: dict[str, float | None] = field(init=False)

    def __post_init__(self) -> None:
        self._url = httpx.URL(f"{self.base_url}/chat/completions")
        self._timeout = httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s).as_dict()

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
        if cap is not None:
            body["max_completion_tokens"] = cap
            if isinstance(body.get("max_tokens"), int):
                body["max_tokens"] = min(body["max_tokens"], cap)
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

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None) -> ModelReply:
        content = orjson.dumps(self.body(request))
        attempt = 0
        while True:
            try:
                if request.stream:
                    return await self._stream(content, on_delta)
                return await self._json(content)
            except _Retry as retry:
                if attempt >= self.max_retries:
                    raise retry.error from None
                attempt += 1
                await asyncio.sleep(retry.delay_s(attempt, self.retry_base_s))

    async def send(
        self,
        method: str,
        url: httpx.URL,
        headers: httpx.Headers | Mapping[str, str] | Sequence[tuple[bytes, bytes]],
        content: bytes | AsyncIterable[bytes] | None = None,
        *,
        timeouts: dict[str, float | None] | None = None,
        caller_error: Callable[[], BaseException | None] | None = None,
    ) -> httpx.Response:
        """One attempt, never retried, counted through `on_attempt` by its outcome. Returns the
        response whatever its status, its body unread: the caller closes it. `timeouts` (httpx's
        extension dict) replace this upstream's.

        Raises UpstreamUnavailable when the connection failed or timed out connecting, and
        UpstreamTimeout when the response did not start in time. `caller_error` gives what the
        caller's `content` stream raised, if anything: the transport reports that as a connection
        failure, but the upstream is not at fault, so it is raised as it is and not counted.
        """
        request = httpx.Request(
            method,
            url,
            content=content,
            headers=headers,
            extensions={"timeout": self._timeout if timeouts is None else timeouts},
        )
        try:
            response = await self.transport.handle_async_request(request)
        except httpx.HTTPError as exc:
            failed = caller_error() if caller_error is not None else None
            if failed is not None:
                raise failed from None
            if isinstance(exc, httpx.TimeoutException):
                self._count("timeout")
                if isinstance(exc, httpx.ConnectTimeout):
                    raise UpstreamUnavailable(f"upstream {self.name} unreachable") from None
                raise UpstreamTimeout(f"upstream {self.name} timed out") from None
            self._count("connect_error")
            raise UpstreamUnavailable(
                f"upstream {self.name} unreachable: {type(exc).__name__}"
            ) from None
        self._count(status_class(response.status_code))
        return response

    async def _send(self, content: bytes) -> httpx.Response:
        try:
            response = await self.send("POST", self._url, self.request_headers(), content)
        except UpstreamUnavailable as unreachable:
            raise _Retry(unreachable) from None  # no answer came: worth another attempt
        if response.status_code >= 400:
            error = await self._status_error(response)
            if response.status_code in RETRY_STATUSES:
                raise _Retry(error, response.headers.get("retry-after"))
            raise error
        return response

    async def _status_error(self, response: httpx.Response) -> UpstreamStatusError:
        """An answer with an error status as the error that relays it; closes the response."""
        async with self.reading(response):
            body = await response.aread()
        return UpstreamStatusError(response.status_code, body, response.headers.get("content-type"))

    async def models(self) -> list[dict[str, Any]]:
        """The models this upstream lists: the entries of `GET {base_url}/models`'s `data` that are
        objects, asked with this upstream's own key, one attempt with a 5 s timeout.

        Raises UpstreamUnavailable or UpstreamTimeout when the upstream cannot be reached or
        answers with something other than a JSON object with a `data` list, and
        UpstreamStatusError for any status but 200.
        """
        response = await self.send(
            "GET",
            httpx.URL(f"{self.base_url}/models"),
            self.request_headers(content_type=None),
            timeouts=MODELS_TIMEOUT,
        )
        if response.status_code != 200:
            raise await self._status_error(response)
        data = (await self._read_object(response)).get("data")
        if not isinstance(data, list):
            raise UpstreamUnavailable(f"upstream {self.name} sent a model list without `data`")
        return [entry for entry in data if isinstance(entry, dict)]

    async def _json(self, content: bytes) -> ModelReply:
        return await self._read_json(await self._send(content))

    @contextlib.asynccontextmanager
    async def reading(self, response: httpx.Response) -> AsyncIterator[None]:
        """Reads of `response`'s body inside fail as UpstreamTimeout or UpstreamUnavailable;
        closes the response at the end."""
        try:
            yield
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"upstream {self.name} timed out") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(
                f"upstream {self.name} failed: {type(exc).__name__}"
            ) from None
        finally:
            await response.aclose()

    async def _read_json(self, response: httpx.Response) -> ModelReply:
        return reply_from_body(await self._read_object(response))

    async def _read_object(self, response: httpx.Response) -> dict[str, Any]:
        async with self.reading(response):
            raw = await response.aread()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamUnavailable(
                f"upstream {self.name} sent a body that is not JSON"
            ) from None
        if not isinstance(body, dict):
            raise UpstreamUnavailable(f"upstream {self.name} sent an unexpected body")
        return body

    async def _stream(self, content: bytes, on_delta: DeltaSink | None) -> ModelReply:
        started = time.monotonic()
        first_chunk_s: float | None = None
        response = await self._send(content)
        if "json" in response.headers.get("content-type", ""):
            # An upstream that ignores `stream` answers with one body: relay it as one delta.
            reply = await self._read_json(response)
            if reply.text and on_delta is not None:
                await on_delta(reply.text)
            reply.raw = None
            return reply
        acc = ChunkAccumulator()
        decoder = SSEDecoder()
        async with self.reading(response):
            async for raw in response.aiter_raw():
                if first_chunk_s is None:
                    first_chunk_s = time.monotonic() - started
                # The deltas of one network read go out as one: fewer, larger client chunks.
                text = "".join(self._deltas(acc, decoder.feed(raw)))
                if text and on_delta is not None:
                    await on_delta(text)
                if decoder.done:
                    break
        reply = acc.reply()
        reply.first_chunk_s = first_chunk_s
        return reply

    def _deltas(self, acc: ChunkAccumulator, events: list[bytes]) -> list[str]:
        deltas = []
        for data in events:
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk and not chunk.get("choices"):
                message = str(chunk["error"])[:500]
                raise UpstreamUnavailable(f"upstream {self.name} failed mid-stream: {message}")
            delta = acc.add(chunk)
            if delta:
                deltas.append(delta)
        return deltas

    def _count(self, outcome: str) -> None:
        if self.on_attempt is not None:
            self.on_attempt(self.name, outcome)


class _Retry(Exception):
    def __init__(self, error: Exception, retry_after: str | None = None) -> None:
        self.error = error
        self.retry_after = retry_after

    def delay_s(self, attempt: int, base_s: float) -> float:
        if self.retry_after:
            try:
                return min(max(float(self.retry_after), 0.0), MAX_RETRY_AFTER_S)
            except ValueError:
                pass
        return float(base_s * 2 ** (attempt - 1) * (0.5 + random.random() / 2))
