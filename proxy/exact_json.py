"""JSON whose integers stay exact past 64 bits, where a tool's arguments and results pass
through the proxy: orjson reads such an integer as a float (2**64 as 1.8446744073709552e+19)
and cannot write one, so a text with 19 digits in a row is read, and a value orjson cannot
write is written, by the standard library (slower, and seldom needed)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import orjson

# A run of 19 digits, found in linear time: digits made NUL, then the run looked for (a regex
# `\d{19}` tries every digit of a run at each start: 18 times the work over runs of 18).
_DIGITS = bytes.maketrans(b"0123456789", b"\0" * 10)
_LONG_RUN = b"\0" * 19
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # half of a pair, or both halves
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


def loads(raw: str | bytes) -> Any:
    """The value of a JSON text; ValueError (or RecursionError, past ~1,000 levels of a text
    read by the standard library) when it is none."""
    text = isinstance(raw, str)
    encoded = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if _LONG_RUN not in encoded.translate(_DIGITS):  # (a NUL of its own: no JSON anyway)
        return orjson.loads(raw)
    value = json.loads(raw, parse_constant=_no_constant)
    if (_SURROGATE if text else _SURROGATE_BYTES).search(raw):  # type: ignore[arg-type]
        _no_lone_surrogate(value)  # as orjson refuses: no UTF-8 could carry it on
    return value


def _no_lone_surrogate(value: Any) -> None:
    """ValueError when a string of `value` (a key too) holds half of a surrogate pair."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone surrogate escape") from None
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _no_constant(name: str) -> Any:
    """`NaN`, `Infinity`: no JSON, which orjson refuses and the standard library reads."""
    raise ValueError(f"{name} is not a JSON value")


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """`value` as compact JSON, keys that are no strings as text, what else is no JSON type
    as `default` makes it; TypeError, ValueError (a value that holds itself) or RecursionError
    when it is no JSON value."""
    try:
        return orjson.dumps(value, default=default, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # an integer past 64 bits, nesting past orjson's 254 levels, a cycle
        text = json.dumps(value, default=default, separators=(",", ":"), ensure_ascii=False)
        return text.encode()
