"""Secrets taken out of a text a client or a model reads (an upstream's error, a tool's
exception): the values it is told of, and whatever looks like a credential."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable

REDACTED = "[redacted]"
# What looks like a credential, whatever key was sent: a bearer token, an `sk-`-style API key,
# a `key=value` pair that names a key, token or secret, a URL's user and password.
_SECRET = re.compile(
    r"""(?ix)
    \bbearer\s+[^\s"',;]+
    | \b(?:sk|rk|pk)-[a-z0-9_\-]{8,}
    | \b(?:api[_-]?key|access[_-]?token|token|secret|password)\b["']?\s*[:=]\s*["']?[^\s"',;&]+
    | (?<=://)[^\s/@:]+:[^\s/@]+(?=@)
    """
)

# The shortest start of a secret redacted where it is echoed alone ("bad key Zq9plainSecr...").
SECRET_PREFIX = 8


def redacted(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with every occurrence of `secrets`, of any SECRET_PREFIX or more characters in a
    row of one, and of everything that looks like a credential replaced by `[redacted]`."""
    for secret in secrets:
        if secret:
            text = _without(text, secret)
    return _SECRET.sub(REDACTED, text)


def _without(text: str, secret: str) -> str:
    """`text` without any SECRET_PREFIX or more characters in a row of `secret` (its start, its
    tail, any piece): each window of the text that is one of the secret's pieces is taken out,
    in one pass over the text (a key of its client's choosing, echoed by an upstream, is no
    longer work a square of its length)."""
    if len(secret) < 2 * SECRET_PREFIX:  # a piece of it could be a common word
        return text.replace(secret, REDACTED)
    width = SECRET_PREFIX
    pieces = {secret[i : i + width] for i in range(len(secret) - width + 1)}
    out: list[str] = []
    kept = start = 0  # the text before `kept` is in `out`; the span being taken out begins
    cut = -1  # where the span being taken out ends, or -1
    for at in range(len(text) - width + 1):
        if text[at : at + width] not in pieces:
            continue
        if cut < at:  # a span of its own
            if cut >= 0:
                out += [text[kept:start], REDACTED]
                kept = cut
            start = at
        cut = at + width
    if cut < 0:
        return text
    out += [text[kept:start], REDACTED]
    return "".join(out) + text[cut:]


def origin(url: str) -> str:
    """A URL as a log names it: its scheme, host and port (no user, path or query: they may
    hold a token)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
