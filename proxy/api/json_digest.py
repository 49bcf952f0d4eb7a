"""The sha256 of a JSON array as it grows: the digest of `orjson.dumps(values)` (with `option`)
for all the values added so far, each added value serialised once."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson


class JsonDigest:
    __slots__ = ("_empty", "_hashing", "option")

    def __init__(self, option: int | None = None) -> None:
        self._hashing = hashlib.sha256(b"[")
        self._empty = True
        self.option = option

    def extend(self, values: list[Any]) -> JsonDigest:
        """Adds `values` at the end; gives itself."""
        if values:
            text = memoryview(orjson.dumps(values, option=self.option))
            if not self._empty:
                self._hashing.update(b",")
            self._hashing.update(text[1:-1])
            self._empty = False
        return self

    def copy(self) -> JsonDigest:
        other = JsonDigest(self.option)
        other._hashing, other._empty = self._hashing.copy(), self._empty
        return other

    def hexdigest(self) -> str:
        closed = self._hashing.copy()
        closed.update(b"]")
        return closed.hexdigest()


def without_nulls(value: Any) -> Any:
    """`value` with every object's null members left out, at any depth: the one form of JSON
    documents that differ only in members given as null or left out (as an SDK's model of an
    item, dumped whole, gives every field it knows)."""
    if isinstance(value, dict):
        return {key: without_nulls(member) for key, member in value.items() if member is not None}
    if isinstance(value, list):
        return [without_nulls(member) for member in value]
    return value
