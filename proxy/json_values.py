"""How many values a JSON text holds, counted before it is parsed: what the proxy parses on the
event loop (a request's body, a stored conversation, an MCP server's message) holds it for as
long as the parse takes, and what a text holds decides that time, not its bytes (8 MiB of `[],`
took orjson 0.65 s, and pydantic 4 s for 16 MiB).

The values are counted by their delimiters: a `,`, `:`, `[` or `{` outside a string is one
value (an array of n values has n - 1 commas and an opener; an object's members count twice,
key and value). A text that could not hold more is let through on a cheap count; the exact one,
which skips strings, runs off the event loop.
"""

from __future__ import annotations

import asyncio
import re

import orjson

_DELIMITERS = b",:[{"
_NOT_DELIMITERS = bytes(sorted(set(range(256)) - set(_DELIMITERS)))
# A string (skipped whole, escapes and all) or a delimiter outside one (group 1).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|([,:\[{])')


async def holds_over(raw: bytes | bytearray, limit: int) -> bool:
    """Whether the JSON in `raw` holds more than `limit` values. A text of fewer bytes than the
    bound, or fewer delimiters wherever they are, cannot; any other is counted exactly in a
    thread, off the event loop."""
    return (
        len(raw) > limit
        and delimiters(raw) > limit
        and await asyncio.to_thread(values_over, raw, limit)
    )


def delimiters(raw: bytes | bytearray) -> int:
    """Every delimiter in `raw`, those inside strings too: never fewer than its values. One pass
    in C, ~1 ms a MiB."""
    return len(raw.translate(None, _NOT_DELIMITERS))


def values_over(raw: bytes | bytearray, limit: int) -> bool:
    """Whether `raw` holds more than `limit` JSON values."""
    return values_in(raw, limit) > limit


def values_in(raw: bytes | bytearray, limit: int) -> int:
    """The JSON values `raw` holds, counted up to `limit + 1`: its delimiters outside strings,
    the strings skipped one match at a time. Slow (a string or a delimiter a step, in Python):
    for a thread, and for a text whose `delimiters` are over `limit`."""
    count = 0
    for token in _TOKEN.finditer(raw):
        if token.lastindex:
            count += 1
            if count > limit:
                break
    return count


# orjson reads 1,024 levels of nesting but writes only 254. The proxy puts what it reads into
# objects of its own, a few levels deeper than it came (a Responses tool's `parameters` one
# level down for the upstream, a reply's message in a stored response, settings echoed in
# stream events): what it reads may nest MAX_DEPTH levels, room left for HEADROOM more.
WRITTEN_DEPTH = 254
HEADROOM = 8
MAX_DEPTH = WRITTEN_DEPTH - HEADROOM


def nests_too_deep(raw: bytes | str, value: object) -> bool:
    """Whether `value`, parsed from the JSON text `raw`, nests deeper than MAX_DEPTH levels: a
    text of fewer brackets cannot; any other is asked `too_deep`."""
    if isinstance(raw, bytes):
        brackets = raw.count(b"[") + raw.count(b"{")
    else:
        brackets = raw.count("[") + raw.count("{")
    return brackets > MAX_DEPTH and too_deep(value)


def too_deep(value: object) -> bool:
    """Whether `value` (parsed JSON) nests deeper than MAX_DEPTH levels: it is written once to
    know, with HEADROOM levels around it (in C, as fast as parsing it)."""
    wrapped = value
    for _ in range(HEADROOM):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except TypeError:
        return True
    return False
