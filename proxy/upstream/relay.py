"""Relaying a request the proxy does not implement to an upstream as it is, and its answer back
(SPEC §4: any other `/v1/...`: embeddings, completions, moderations, audio, ...).

Knows nothing of the web framework: the caller gives the method, the raw path and query, the
client's header list and its body as an async iterator of bytes, and gets the upstream's status,
header list and body chunks. Both bodies are streamed: each chunk goes on as it arrives. A
relayed request is sent once: it may not be idempotent.

An upstream's error (a status of 400 or more) is not relayed as it came: its body becomes an
OpenAI-shaped error, scrubbed of secrets (`error_body`), and a status no client can be given
(600 and over) is a 502.

Which upstream gets a request is the caller's choice; `sniff_model` reads the `model` of a JSON
body or a form for it, which means reading some of it (MODEL_SNIFF_LIMIT bytes of JSON, or
another bound; FORM_MODEL_WITHIN of a form) before sending it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson

from proxy.errors import InvalidRequest, UpstreamBadReply, UpstreamStatusError
from proxy.json_values import MAX_DEPTH, holds_over, nests_too_deep
from proxy.upstream.client import Upstream
from proxy.upstream.form_model import FormModel, form_boundary
from proxy.upstream.transport import Answer

# A JSON body up to this size is read whole to find its model, unless told another bound; a
# larger one is not parsed.
MODEL_SNIFF_LIMIT = 1 << 20
# A form's `model` field is looked for in its first bytes only (the openai SDK sends it first;
# the file after it is streamed on, never held).
FORM_MODEL_WITHIN = 1 << 20

# RFC 9110 §7.6.1: headers for one connection only, as is every `proxy-*` header and every header
# a `connection` header names.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade"}
)
NOT_FORWARDED = frozenset(
    {
        b"host",  # the upstream's, from the URL
        b"content-length",  # the body is streamed: chunked, or none
        b"authorization",  # the proxy's own key: the upstream's is sent instead
        b"traceparent",  # the proxy's own trace context replaces the client's
        b"tracestate",
        b"baggage",  # the client's user and tenant ids: not the upstream provider's to read
        b"expect",  # a `100-continue` was answered by the server that read the client's body
    }
)
# The proxy's own headers (`x-loopwarden-run-id`, ...): never an upstream's to send on.
OWN_HEADERS = b"x-loopwarden-"
# The server that serves the proxy adds its own (uvicorn does, whatever the app sends).
NOT_RETURNED = frozenset({b"date", b"server"})
# What no longer describes an upstream's error once the proxy has rewritten its body.
NOT_RETURNED_WITH_AN_ERROR = NOT_RETURNED | {
    b"content-type",
    b"content-length",
    b"content-encoding",
    b"content-language",
    b"content-disposition",
    b"etag",
}


@dataclass(frozen=True, slots=True)
class Relayed:
    """The upstream's answer: send `status` and `headers` on as they are, then each chunk of
    `body` as it comes. `body` is the raw body, as the upstream encoded it; reading it raises
    UpstreamTimeout or UpstreamUnavailable when the upstream stalls or fails midway."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: AsyncIterator[bytes]


def upstream_url(base_url: str, path: str, query: str = "") -> str:
    """`base_url` plus what follows `/v1` in `path`: `/v1/embeddings` is
    `{base_url}/embeddings`. `path` is the raw request path (ASGI `raw_path`, still
    percent-encoded, so an encoded `/` inside an id stays one) and `query` the raw query string;
    both go on unchanged.

    Raises ValueError for a path outside `/v1/` or with a `.` or `..` segment, encoded or not,
    between slashes or backslashes, encoded or not (a server in front that decodes and
    normalises the path would climb them): the upstream's key must not reach other paths of its
    host.
    """
    if not path.startswith("/v1/"):
        raise ValueError(f"not a /v1/ path: {path!r}")
    if any(part in (".", "..") for part in _SEPARATORS.split(unquote(path))):
        raise ValueError(f"a path with a dot segment: {path!r}")
    target = f"{base_url.rstrip('/')}{path[3:]}"
    return f"{target}?{query}" if query else target


_SEPARATORS = re.compile(r"[/\\]")


def forwarded_headers(
    client: Iterable[tuple[bytes, bytes]], upstream: Upstream
) -> list[tuple[str, str]]:
    """The client's headers as they go to `upstream`: without the hop-by-hop ones and those in
    NOT_FORWARDED, and with the upstream's own (its key, `accept-encoding: identity`, the trace
    context when the hook is set) replacing any of the same name. `client` names are lowercase,
    as ASGI gives them."""
    own = upstream.request_headers(content_type=None)
    replaced = NOT_FORWARDED | {name.encode("latin-1") for name in own}
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in _end_to_end(client, replaced)]
    return headers + list(own.items())


def returned_headers(upstream: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers as they go to the client, names lowercased: without the
    hop-by-hop ones, `date`, `server` and the proxy's own (OWN_HEADERS). `content-encoding`
    and `content-length` stay true, since the body goes on as the raw bytes that came, except a
    `content-length` that came with a `transfer-encoding`, which it does not describe."""
    lowered = [(k.lower(), v) for k, v in upstream]
    dropped = NOT_RETURNED
    if any(k == b"transfer-encoding" for k, _ in lowered):
        dropped |= {b"content-length"}
    return _end_to_end(lowered, dropped)


def json_model(content_type: str | None, body: bytes, limit: int = MODEL_SNIFF_LIMIT) -> str | None:
    """The top-level string `model` of a JSON object, given the whole body. None when the content
    type is not JSON (a form's is read by `sniff_model`), the body is
    over `limit` bytes (not parsed), not JSON or not an object, or its `model` is not a string.
    """
    parsed = _json_object(content_type, body, limit)
    model = parsed.get("model") if parsed is not None else None
    return model if isinstance(model, str) else None


def _json_object(content_type: str | None, body: bytes, limit: int) -> dict[str, Any] | None:
    if not _is_json(content_type) or len(body) > limit:
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


async def sniff_model(
    headers: Iterable[tuple[bytes, bytes]],
    body: AsyncIterable[bytes],
    limit: int = MODEL_SNIFF_LIMIT,
    exact: bool = False,
    max_values: int | None = None,
) -> tuple[str | None, AsyncIterator[bytes]]:
    """The model a request names (see `json_model`; a form's `model` field), and its body to
    relay: the bytes read to find it, then the rest, unread. Only a JSON body whose
    `content-length`, if given, is at most `limit` is read, and only until more than `limit`
    bytes came; a `multipart/form-data` body until its `model` field ended, within its first
    FORM_MODEL_WITHIN bytes; any other body is left as it is.

    A JSON body over `limit` bytes, or holding more than `max_values` JSON values (which it
    would take long to parse on the event loop: 1 MiB of `[],` takes 35 ms), goes to the
    default upstream, whatever model it names.

    `exact`, for a caller whose models are checked: the body relayed is the object as read, so
    that no upstream reads another model in it than the one checked (from a repeated `model`,
    which parsers take first or last, or a `MODEL`, which some match); a body that names one in
    another case has none. A form's rest is read as it is relayed, and raises AmbiguousModel at
    a second part named `model` in any case, or at a part that parsers may read otherwise
    (`FormModel.strict`): the upstream then gets no whole body. A request with two content
    types, or a form's with a parameter besides its boundary, has none.
    """
    chunks = aiter(body)
    content_type = content_length = None
    types = 0
    for name, value in headers:
        if name == b"content-type":
            types += 1
            content_type = content_type or value.decode("latin-1")  # as servers read it
        elif name == b"content-length" and value.isdigit():
            content_length = int(value)
    if exact and types > 1:  # which one an upstream reads is its own choice
        return None, chunks
    if (form := form_boundary(content_type)) is not None:
        boundary, plain = form
        if exact and not plain:  # an upstream may read its names by its `charset`
            return None, chunks
        return await _form_model(boundary, chunks, FORM_MODEL_WITHIN, exact)
    if not _is_json(content_type) or (content_length is not None and content_length > limit):
        return None, chunks
    read: list[bytes] = []
    size = 0
    async for chunk in chunks:
        read.append(chunk)
        size += len(chunk)
        if size > limit:
            break
    head = b"".join(read)
    if max_values is not None and await holds_over(head, max_values):
        return None, _prepend(head, chunks)
    if not exact:
        return json_model(content_type, head, limit), _prepend(head, chunks)
    parsed = _json_object(content_type, head, limit)
    named = [key for key in parsed or () if key.lower() == "model"]
    if parsed is None or named != ["model"] or not isinstance(parsed["model"], str):
        return None, _prepend(head, chunks)
    if nests_too_deep(head, parsed):  # (written again below, which orjson refuses past 254)
        raise InvalidRequest(f"the body nests deeper than {MAX_DEPTH} levels")
    return parsed["model"], _prepend(orjson.dumps(parsed), chunks)


async def _form_model(
    boundary: bytes, chunks: AsyncIterator[bytes], limit: int, exact: bool
) -> tuple[str | None, AsyncIterator[bytes]]:
    """`sniff_model` of a form: read until its first `model` field ended, within `limit`
    bytes. With `exact`, a form with another part named `model` in what was read has none,
    and the rest is read as it is relayed, raising AmbiguousModel at another (the upstream
    then gets no whole body)."""
    form = FormModel(boundary, strict=exact)
    read: list[bytes] = []
    size = 0
    async for chunk in chunks:
        read.append(chunk)
        size += len(chunk)
        form.feed(chunk)
        if form.values or form.broken or size > limit:
            break
    if not exact:
        return form.model, _prepend(b"".join(read), chunks)
    model = form.model if len(form.names) == 1 else None
    return model, _prepend(b"".join(read), form.checked(chunks))


@contextlib.asynccontextmanager
async def relay(
    upstream: Upstream,
    method: str,
    path: str,
    *,
    query: str = "",
    headers: Iterable[tuple[bytes, bytes]] = (),
    body: AsyncIterable[bytes] | None = None,
) -> AsyncIterator[Relayed]:
    """Sends the client's request to `upstream` once and gives its answer for the block; the
    upstream response is closed when the block ends. `path` and `query` are as `upstream_url`
    takes them, `headers` (the client's) as `forwarded_headers` does. `body` is streamed as it
    is read; one that ends without a byte is sent as no body. An answer with a status of 400 to
    599 is given with the upstream's error, OpenAI-shaped and scrubbed (`error_answer`).

    Raises ValueError for a path `upstream_url` refuses; UpstreamUnavailable or UpstreamTimeout
    when no answer started (counted through `on_attempt`, like every attempt); UpstreamBadReply
    for a redirect or a status of 600 or more; and whatever `body` raised (a client that left)
    as it is, not counted, when the client's body failed.
    """
    url = upstream_url(upstream.base_url, path, query)
    sent = await _CallerBody.of(body) if body is not None else None
    response = await upstream.send(
        method,
        url,
        forwarded_headers(headers, upstream),
        sent,
        caller_error=sent.failure if sent is not None else None,
    )
    try:
        if response.status >= 400:
            yield await error_answer(upstream, response)
            return
        if 300 <= response.status < 400:  # its location is the upstream's, not the client's
            raise UpstreamBadReply(
                f"upstream {upstream.name} answered HTTP {response.status}, a redirect the "
                "proxy does not follow"
            )
        chunks = _chunks(upstream, response)
        try:
            yield Relayed(response.status, returned_headers(response.raw_headers()), chunks)
        finally:
            await chunks.aclose()
    finally:
        await response.aclose()


async def error_answer(upstream: Upstream, response: Answer) -> Relayed:
    """An upstream's error answer as it goes to the client: its status and headers (but those
    of its body), and its error as an OpenAI-shaped JSON body, scrubbed. Raises the error
    itself when it cannot be relayed (a status of 600 or more: UpstreamBadReply)."""
    error = await upstream.status_error(response)
    if not isinstance(error, UpstreamStatusError):
        raise error
    content = orjson.dumps(error.body())
    headers = _end_to_end(
        [(k.lower(), v) for k, v in response.raw_headers()], NOT_RETURNED_WITH_AN_ERROR
    )
    headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]
    return Relayed(error.status, headers, _prepend(content, _nothing()))


class _CallerBody:
    """The client's body as the transport reads it, keeping what it raised: the transport would
    report that as a failure of the upstream connection."""

    def __init__(self, first: bytes, rest: AsyncIterator[bytes]) -> None:
        self.first = first
        self.rest = rest
        self.error: Exception | None = None

    @classmethod
    async def of(cls, body: AsyncIterable[bytes]) -> _CallerBody | None:
        """None for a body that ends without a byte (a GET's), so that none is sent."""
        chunks = aiter(body)
        async for chunk in chunks:
            if chunk:
                return cls(chunk, chunks)
        return None

    def failure(self) -> Exception | None:
        return self.error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.first
        try:
            async for chunk in self.rest:
                yield chunk
        except Exception as exc:
            self.error = exc
            raise


async def _chunks(upstream: Upstream, response: Answer) -> AsyncGenerator[bytes]:
    async with upstream.reading(response):
        async for chunk in response.chunks():
            yield chunk


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield


async def _prepend(head: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if head:
        yield head
    async for chunk in rest:
        yield chunk


def _end_to_end(
    headers: Iterable[tuple[bytes, bytes]], dropped: frozenset[bytes]
) -> list[tuple[bytes, bytes]]:
    """`headers` (lowercase names) without the hop-by-hop ones and those in `dropped`."""
    headers = list(headers)
    named = {
        token.strip().lower()
        for name, value in headers
        if name == b"connection"
        for token in value.split(b",")
    }
    dropped = dropped | HOP_BY_HOP | named
    return [
        (k, v)
        for k, v in headers
        if k not in dropped and not k.startswith((b"proxy-", OWN_HEADERS))
    ]


def _is_json(content_type: str | None) -> bool:
    if content_type is None:
        return False
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")
