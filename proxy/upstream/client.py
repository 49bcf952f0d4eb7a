"""An OpenAI-compatible upstream as the engine's `ChatModel`: JSON or SSE, with retries."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
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

    def _headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
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

    async def _send(self, content: bytes) -> httpx.Response:
        request = httpx.Request(
            "POST",
            self._url,
            content=content,
            headers=self._headers(),
            extensions={"timeout": self._timeout},
        )
        try:
            response = await self.transport.handle_async_request(request)
        except httpx.TimeoutException as exc:
            self._count("timeout")
            if isinstance(exc, httpx.ConnectTimeout):
                raise _Retry(UpstreamUnavailable(f"upstream {self.name} unreachable")) from None
            raise UpstreamTimeout(f"upstream {self.name} timed out") from None
        except httpx.HTTPError as exc:
            self._count("connect_error")
            unreachable = UpstreamUnavailable(
                f"upstream {self.name} unreachable: {type(exc).__name__}"
            )
            raise _Retry(unreachable) from None
        self._count(status_class(response.status_code))
        if response.status_code >= 400:
            async with self._reading(response):
                body = await response.aread()
            error = UpstreamStatusError(
                response.status_code, body, response.headers.get("content-type")
            )
            if response.status_code in RETRY_STATUSES:
                raise _Retry(error, response.headers.get("retry-after"))
            raise error
        return response

    async def _json(self, content: bytes) -> ModelReply:
        return await self._read_json(await self._send(content))

    @contextlib.asynccontextmanager
    async def _reading(self, response: httpx.Response) -> AsyncIterator[None]:
        """Maps failures while reading a response body; closes the response."""
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
        async with self._reading(response):
            raw = await response.aread()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamUnavailable(
                f"upstream {self.name} sent a body that is not JSON"
            ) from None
        if not isinstance(body, dict):
            raise UpstreamUnavailable(f"upstream {self.name} sent an unexpected body")
        return reply_from_body(body)

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
        async with self._reading(response):
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
