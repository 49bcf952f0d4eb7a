"""An upstream's error answer as the proxy relays it: OpenAI-shaped, with the upstream's status
and its own message, type, param and code when it sent an OpenAI-shaped JSON error, a generic
message otherwise; every string scrubbed of secrets and capped in length. An upstream that
echoes the key it was sent, or answers with an HTML page, never has that reach a client."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import orjson

from proxy.errors import UpstreamBadReply, UpstreamFailure, UpstreamStatusError
from proxy.redaction import redacted

# Statuses relayed as the upstream's error; any other is no status a client can be given.
RELAYED_STATUSES = range(400, 600)
ERROR_BODY_LIMIT = 64 * 1024  # of an error body, no more is read
MESSAGE_LIMIT = 1000
FIELD_LIMIT = 200


def scrub(text: str, secrets: Iterable[str | None] = (), limit: int = MESSAGE_LIMIT) -> str:
    """`text` without secrets (`redaction.redacted`), cut to `limit` characters: cut first to
    what can still show after it (a secret cut in half is redacted as a piece of it)."""
    secrets = list(secrets)
    text = text[: limit + 2 * max((len(s or "") for s in secrets), default=0) + 256]
    text = redacted(text, secrets)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def status_failure(
    upstream: str,
    status: int,
    body: bytes,
    content_type: str | None,
    secrets: Iterable[str | None] = (),
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> UpstreamFailure:
    """The error an upstream's answer with a non-success `status` is relayed as: an
    UpstreamStatusError for a status in RELAYED_STATUSES, with those of its `headers` a
    client's retry reads (`retry_headers`), else an UpstreamBadReply (502)."""
    if status not in RELAYED_STATUSES:
        return UpstreamBadReply(f"upstream {upstream} answered HTTP {status}, which is not a reply")
    error = _openai_error(body)
    kept = retry_headers(headers)
    if error is None:
        generic = _generic(upstream, status, body, content_type)
        return UpstreamStatusError(status, generic, retry_headers=kept)
    secrets = tuple(secrets)
    message = error.get("message")
    return UpstreamStatusError(
        status,
        scrub(message, secrets) if isinstance(message, str) else f"upstream returned HTTP {status}",
        error_type=_field(error.get("type"), secrets),
        param=_field(error.get("param"), secrets),
        code=_field(error.get("code"), secrets, numbered=True),
        retry_headers=kept,
    )


# The headers of an error answer that tell a client when to try again (the OpenAI SDKs read
# `retry-after-ms` and `retry-after`; `x-ratelimit-*` give the limits and what is left).
RETRY_HEADERS = (b"retry-after", b"retry-after-ms")
RATE_LIMIT_PREFIX = b"x-ratelimit-"
MAX_RETRY_HEADERS = 16
RETRY_HEADER_LIMIT = 256  # bytes of a value; a longer one is no time or count


def retry_headers(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """Those of an error answer's `headers` that a client's retry reads, the first of each
    name, at most MAX_RETRY_HEADERS of them, values of printable ASCII within
    RETRY_HEADER_LIMIT bytes."""
    kept: dict[str, str] = {}
    for raw_name, value in headers:
        name = raw_name.lower()
        if not (name in RETRY_HEADERS or name.startswith(RATE_LIMIT_PREFIX)):
            continue
        if len(kept) >= MAX_RETRY_HEADERS or len(value) > RETRY_HEADER_LIMIT:
            continue
        if not (value.isascii() and value.decode().isprintable()):
            continue
        kept.setdefault(name.decode(), value.decode())
    return kept


def mid_stream_message(error: Any, secrets: Iterable[str | None] = ()) -> str:
    """The message of an `error` member an upstream sent inside a stream, scrubbed."""
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return scrub(error["message"], secrets)
    if isinstance(error, str):
        return scrub(error, secrets)
    return "an error without a message"


def _openai_error(body: bytes) -> dict[str, Any] | None:
    """The `error` object of an OpenAI-shaped JSON error body (`{"error": "text"}` counts, as
    its message), else None."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, str):
        return {"message": error}
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error
    return None


def _field(value: Any, secrets: tuple[str | None, ...], numbered: bool = False) -> str | None:
    """A string field of the error, scrubbed; a number too when `numbered` (some upstreams give
    their `code` as the HTTP status), as its text."""
    if numbered and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    return scrub(value, secrets, FIELD_LIMIT) if isinstance(value, str) else None


def _generic(upstream: str, status: int, body: bytes, content_type: str | None) -> str:
    if not body.strip():
        return f"upstream {upstream} answered HTTP {status} with no body"
    media = (content_type or "").partition(";")[0].strip().lower()
    if not re.fullmatch(r"[a-z0-9.+\-]+/[a-z0-9.+\-]+", media):
        return f"upstream {upstream} answered HTTP {status}; its body is not shown"
    return f"upstream {upstream} answered HTTP {status}; its {media} body is not shown"
