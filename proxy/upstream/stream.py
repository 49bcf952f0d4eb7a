"""Reading an upstream's answer into one reply: a JSON body, or an SSE stream whose content
deltas go on as they come. Both are bounded (ReplyLimits) while they are read, and nothing of
them is dropped without a word: invalid UTF-8 is replaced and logged; an event that is not a
JSON object, an `error` event, or a stream that ends with neither `[DONE]` nor a finish reason
fails the step (UpstreamBadReply)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import orjson

from proxy.engine.values import DeltaSink, ModelReply
from proxy.errors import UpstreamBadReply
from proxy.json_values import MAX_DEPTH, holds_over, nests_too_deep
from proxy.parse_turns import LARGE_TEXT, parse_turn
from proxy.upstream.error_body import mid_stream_message
from proxy.upstream.reply import ChunkAccumulator, MalformedReply, ReplyLimits, reply_from_body
from proxy.upstream.sse import ErrorEvent, EventTooLarge, SSEDecoder

log = logging.getLogger(__name__)

# The most of one network read decoded at once: a read of a megabyte of tiny events (or lines)
# is decoded in slices, so that other requests are served between them.
READ_SLICE = 64 * 1024


class ReplyReader:
    """Reads the answers of one upstream (`name`, used in messages), sent `secrets` (scrubbed
    from any error message it relays), within `limits`."""

    def __init__(self, name: str, limits: ReplyLimits, secrets: Iterable[str | None]) -> None:
        self.name = name
        self.limits = limits
        self.secrets = tuple(secrets)

    async def body(self, chunks: AsyncIterator[bytes], content_length: str | None) -> bytes:
        """A whole body, refused as soon as it (or its declared length) passes the limit."""
        limit = self.limits.max_response_bytes
        if content_length is not None and content_length.isdigit() and int(content_length) > limit:
            raise self._too_large()
        read: list[bytes] = []
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise self._too_large()
            read.append(chunk)
        return b"".join(read)

    def json_object(self, raw: bytes) -> dict[str, Any]:
        body = self._json(raw, "a body")
        if not isinstance(body, dict):
            raise UpstreamBadReply(f"upstream {self.name} sent a body that is not a JSON object")
        if nests_too_deep(raw, body):  # no answer or record could hold it
            raise UpstreamBadReply(
                f"upstream {self.name} sent a body nested deeper than {MAX_DEPTH} levels"
            )
        return body

    def reply(self, body: dict[str, Any]) -> ModelReply:
        try:
            return reply_from_body(body, self.limits)
        except MalformedReply as exc:
            raise self._malformed(exc) from None

    async def stream(
        self, chunks: AsyncIterator[bytes], on_delta: DeltaSink | None, started: float
    ) -> ModelReply:
        """The reply of an SSE stream; the deltas of one network read go on as one, so a
        client gets fewer, larger chunks. What came before a failure goes on before it is
        raised, whether the failure came in the same read or a later one. `started` is when
        the request was sent (`time.monotonic()`), for the reply's `first_chunk_s`."""
        acc = ChunkAccumulator(self.limits)
        decoder = SSEDecoder(min(self.limits.max_event_bytes, self.limits.max_response_bytes))
        limit = self.limits.max_response_bytes
        size = 0
        first_chunk_s: float | None = None
        begun = False  # the sink heard that the answer has begun
        sound = False  # an event was read, and is sound
        try:
            async for raw in chunks:
                if first_chunk_s is None:
                    first_chunk_s = time.monotonic() - started
                size += len(raw)
                if size > limit:
                    raise self._too_large()
                deltas: list[str] = []
                failure: Exception | None = None
                try:
                    for at in range(0, len(raw), READ_SLICE):
                        if at:  # a long read is decoded in slices, the event loop free between
                            await asyncio.sleep(0)  # (a megabyte of empty events: 80 ms)
                        piece = raw[at : at + READ_SLICE] if len(raw) > READ_SLICE else raw
                        small = len(piece) + decoder.held < LARGE_TEXT  # its events, all
                        for data in decoder.feed(piece):
                            if small or len(data) < LARGE_TEXT:
                                delta = self._add(acc, data)
                            else:  # one at a time a process, as whole replies are
                                async with parse_turn(len(data)):
                                    await self._bounded(data)
                                    delta = self._add(acc, data)
                            if delta:
                                deltas.append(delta)
                            sound = True
                        if decoder.done:
                            break
                except (MalformedReply, UpstreamBadReply) as exc:
                    failure = exc
                if on_delta is not None:
                    if begun:
                        if deltas:
                            await on_delta("".join(deltas))
                    elif sound:  # its first event was read, and is sound
                        begun = True
                        await on_delta.begin(acc.head or {}, "".join(deltas))
                failure = failure or decoder.failure
                if failure is not None:
                    raise failure
                if decoder.done:
                    break
        except EventTooLarge as exc:
            raise UpstreamBadReply(f"upstream {self.name} sent {exc} (max_event_bytes)") from None
        except ErrorEvent as exc:
            raise self._failed(self._error_event(exc.args[0])) from None
        except MalformedReply as exc:
            raise self._malformed(exc) from None
        if acc.finish_reason is None:  # a reply cut short, [DONE] or not
            missing = "no finish_reason" if decoder.done else "no finish_reason and no [DONE]"
            raise UpstreamBadReply(
                f"upstream {self.name}'s stream ended before the reply was complete ({missing})"
            )
        try:
            reply = acc.reply()
        except MalformedReply as exc:
            raise self._malformed(exc) from None
        reply.first_chunk_s = first_chunk_s
        return reply

    async def _bounded(self, data: bytes) -> None:
        """A large event's values are bounded before it is parsed, each as a whole reply's
        are (`max_response_values`): 8 MiB of `[],` in one event held the event loop 1.2 s.
        (A small one is parsed in no time; a reply's events are read a slice at a time.)"""
        if await holds_over(data, self.limits.max_values):
            raise UpstreamBadReply(
                f"upstream {self.name} sent an event of more than {self.limits.max_values} "
                "JSON values (max_response_values)"
            )

    def _add(self, acc: ChunkAccumulator, data: bytes) -> str | None:
        try:  # as `_json` does, without a call more for every event of every stream
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = self._json(data, "an event")
        if not isinstance(chunk, dict):
            raise UpstreamBadReply(f"upstream {self.name} sent an event that is not a JSON object")
        if "error" in chunk and not chunk.get("choices"):
            raise self._failed(chunk["error"])
        return acc.add(chunk)

    @staticmethod
    def _error_event(data: bytes) -> Any:
        """The error an `error` event holds: its JSON (its `error`, when it has one), else its
        text."""
        try:
            sent = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data.decode(errors="replace")
        return sent.get("error", sent) if isinstance(sent, dict) else sent

    def _failed(self, error: Any) -> UpstreamBadReply:
        """What an error the upstream sent mid-stream fails the step with."""
        message = mid_stream_message(error, self.secrets)
        return UpstreamBadReply(f"upstream {self.name} failed mid-stream: {message}")

    def _json(self, raw: bytes, what: str) -> Any:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        try:
            raw.decode()
        except UnicodeDecodeError:
            log.warning("upstream %s sent %s with invalid UTF-8; replaced", self.name, what)
            try:
                return orjson.loads(raw.decode(errors="replace"))
            except orjson.JSONDecodeError:
                pass
        raise UpstreamBadReply(f"upstream {self.name} sent {what} that is not JSON")

    def _too_large(self) -> UpstreamBadReply:
        limit = self.limits.max_response_bytes
        return UpstreamBadReply(
            f"upstream {self.name} sent a reply of more than {limit} bytes (max_response_bytes)"
        )

    def _malformed(self, exc: MalformedReply) -> UpstreamBadReply:
        return UpstreamBadReply(f"upstream {self.name} sent a malformed reply: {exc}")
