"""Counting the JSON values of a text before it is parsed (`delimiters`, `values_over`)."""

from __future__ import annotations

import orjson
import pytest

from proxy.json_values import delimiters, values_over


def walked(value: object) -> int:
    """What `values_over` counts, by walking the parsed value: an array is its opener and a
    comma between each two items; an object the same, plus a colon per member."""
    if isinstance(value, list):
        return 1 + max(0, len(value) - 1) + sum(walked(v) for v in value)
    if isinstance(value, dict):
        return 1 + max(0, len(value) - 1) + len(value) + sum(walked(v) for v in value.values())
    return 0


PUNCTUATED = 'a "quoted", [bracketed]: {braced}, and \\ back\\slashed, \u00e9'


@pytest.mark.parametrize(
    "value",
    [
        {"messages": [{"role": "user", "content": "x"}] * 700},
        {"messages": [{"role": "user", "content": PUNCTUATED * 20}] * 60},
        {"a": [[], {}, [[1, 2], {"b": None}], "s,t:u[v{w"] * 300},
        [0] * 3000,
    ],
)
def test_the_count_is_the_delimiters_outside_strings(value: object) -> None:
    raw = orjson.dumps(value)
    count = walked(value)
    assert values_over(raw, count - 1)
    assert not values_over(raw, count)
    assert delimiters(raw) >= count  # the rough count, strings included, is never below


def test_delimiters_inside_strings_never_count() -> None:
    """Strings full of delimiters (and escaped quotes) are in the rough count, not in the
    exact one."""
    text = ('he said \\"a, b: [c] {d}\\" ' * 400).encode()
    raw = b'{"messages": [{"role": "user", "content": "' + text + b'"}]}'
    assert delimiters(raw) == 7 + 4 * 400
    assert not values_over(raw, 7)  # { : [ { : , :
    assert values_over(raw, 6)
