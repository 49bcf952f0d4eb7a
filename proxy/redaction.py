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
    if len(secret) < 2 * SECRET_PREFIX:  # a piece of it could be a common word
        return text.replace(secret, REDACTED)
    spans: list[tuple[int, int]] = []  # what to take out, found in `text` as it came
    for offset in range(len(secret) - SECRET_PREFIX + 1):  # its start, its tail, any piece
        piece = secret[offset : offset + SECRET_PREFIX]
        at = text.find(piece)
        while at >= 0:
            end = at + SECRET_PREFIX
            while (
                end < len(text)
                and offset + end - at < len(secret)
                and text[end] == secret[offset + end - at]
            ):
                end += 1
            spans.append((at, end))
            at = text.find(piece, at + 1)
    if not spans:
        return text
    out, last = [], 0
    for start, end in sorted(spans):
        if start > last:
            out += [text[last:start], REDACTED]
        elif not out:
            out.append(REDACTED)
        last = max(last, end)
    return "".join(out) + text[last:]


def origin(url: str) -> str:
    """A URL as a log names it: its scheme, host and port (no user, path or query: they may
    hold a token)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
