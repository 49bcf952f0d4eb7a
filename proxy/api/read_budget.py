"""What one request may read of stored responses' records (SPEC §12.4), charged before each
record is parsed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from proxy.config.server import ServerConfig
from proxy.json_values import delimiters, values_in

# What one request may read of stored responses' records (the input items of a listing, the
# responses a create's item references name), in bytes and in JSON values, past
# `server.max_body_bytes` and `server.max_body_values` times this: a chain whose conversation
# still fits a request holds about one request body in its input items and as much in its
# outputs.
READ_BODIES = 4


@dataclass(slots=True)
class ReadBudget:
    """What the records one request reads may hold together, charged before each is parsed:
    READ_BODIES request bodies, in bytes and in values. Items may carry fields the proxy keeps
    but never reads: bytes alone do not bound the parse. A record's values are first its JSON
    delimiters, those inside strings too (never fewer than its values; one pass in C), and
    counted exactly, off the event loop, when those would pass the budget."""

    max_bytes: int
    max_values: int
    read_bytes: int = 0
    read_values: int = 0

    @classmethod
    def of(cls, bounds: ServerConfig) -> ReadBudget:
        return cls(READ_BODIES * bounds.max_body_bytes, READ_BODIES * bounds.max_body_values)

    async def charge(self, record: bytes) -> str | None:
        """Counts `record`; what the records read now pass, if anything ("600 bytes (...)")."""
        self.read_bytes += len(record)
        if self.read_bytes > self.max_bytes:
            return f"{self.max_bytes} bytes ({READ_BODIES} x server.max_body_bytes)"
        values = delimiters(record)
        left = self.max_values - self.read_values
        if values > left:  # its strings' commas and colons too: count them out
            values = await asyncio.to_thread(values_in, record, left)
        self.read_values += values
        if self.read_values > self.max_values:
            return f"{self.max_values} values ({READ_BODIES} x server.max_body_values)"
        return None

    @property
    def bytes_left(self) -> int:
        return max(0, self.max_bytes - self.read_bytes)
