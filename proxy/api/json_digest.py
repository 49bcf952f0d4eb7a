"""The sha256 of a JSON array as it grows: the digest of `orjson.dumps(values)` (with `option`)
for all the values added so far, each added value serialised once."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

import orjson

# The values `JsonDigest.extended` forms and serialises at a time, giving the loop to others
# between: a conversation of 20,000 messages takes ~30 ms to hash, ~0.4 ms a piece.
PIECE = 256
HASHED_AWAY = 1 << 20  # a longer piece's text is hashed on a thread, the loop free meanwhile


class JsonDigest:
    __slots__ = ("_empty", "_hashing", "option")

    def __init__(self, option: int | None = None) -> None:
        self._hashing = hashlib.sha256(b"[")
        self._empty = True
        self.option = option

    def extend(self, values: list[Any]) -> JsonDigest:
        """Adds `values` at the end; gives itself."""
        if values:
            self._hashing.update(self._next_text(values))
        return self

    def _next_text(self, values: list[Any]) -> memoryview:
        """Hashes the comma before `values` (some), and gives their text, to hash next."""
        if not self._empty:
            self._hashing.update(b",")
        self._empty = False
        return memoryview(orjson.dumps(values, option=self.option))[1:-1]

    async def extended(
        self, values: list[Any], form: Callable[[list[Any]], list[Any]] = list
    ) -> JsonDigest:
        """`extend` with `form` of `values`, PIECE values at a time, giving the loop to other
        requests between pieces (a long piece hashed on a thread); gives itself."""
        for at in range(0, len(values), PIECE):
            if at:
                await asyncio.sleep(0)
            piece = form(values[at : at + PIECE])
            if piece:
                text = self._next_text(piece)
                if len(text) > HASHED_AWAY:  # hashlib lets go of the GIL as it hashes
                    await asyncio.to_thread(self._hashing.update, text)
                else:
                    self._hashing.update(text)
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
