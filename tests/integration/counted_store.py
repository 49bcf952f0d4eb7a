"""State backends for tests: the memory backend counting what was asked of it (CountedStore),
failing every record write (ForgetfulStore), or holding every record write until let go
(StalledWrites)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from proxy.errors import StateUnavailable
from proxy.state.memory import MemoryStore
from proxy.state.store import Record


class CountedStore(MemoryStore):
    """`reads`: the (kind, key) pairs each read asked for; `read`: the bytes the reads found;
    `writes`: the kinds each write put, and the thread it kept; `kept`: the records each write
    kept; `written`: the bytes of the records written; `deletes`: the pairs each delete asked
    for. The reads `failing` names (`get_record`, `get_records`) fail as a backend down does."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[list[tuple[str, str]]] = []
        self.read = 0
        self.writes: list[tuple[list[str], str | None]] = []
        self.kept: list[list[tuple[str, str]]] = []
        self.written = 0
        self.deletes: list[list[tuple[str, str]]] = []
        self.failing: set[str] = set()

    def clear(self) -> None:
        self.reads, self.read, self.writes, self.kept, self.written = [], 0, [], [], 0
        self.deletes = []

    def reads_of(self, kind: str) -> list[int]:
        """How many records of `kind` each read that asked for one asked for."""
        return [n for pairs in self.reads if (n := sum(k == kind for k, _ in pairs))]

    def _unless_failing(self, method: str) -> None:
        if method in self.failing:
            raise StateUnavailable("the state backend is unreachable")

    async def get_record(self, kind: str, key: str) -> bytes | None:
        self._unless_failing("get_record")
        found = await super().get_record(kind, key)
        self.reads.append([(kind, key)])
        self.read += len(found or b"")
        return found

    async def get_records(
        self, wanted: Sequence[tuple[str, str]], max_bytes: int | None = None
    ) -> list[bytes | None]:
        self._unless_failing("get_records")
        found = await super().get_records(wanted, max_bytes)
        self.reads.append(list(wanted))
        self.read += sum(len(value or b"") for value in found)
        return found

    async def put_records(
        self,
        records: Sequence[Record],
        ttl_s: float,
        keep_thread: str | None = None,
        keep: Sequence[tuple[str, str]] = (),
    ) -> int:
        self.writes.append(([record.kind for record in records], keep_thread))
        self.kept.append(list(keep))
        self.written += sum(len(record.value) for record in records)
        return await super().put_records(records, ttl_s, keep_thread, keep)

    async def delete_records(self, wanted: Sequence[tuple[str, str]]) -> int:
        self.deletes.append(list(wanted))
        return await super().delete_records(wanted)


class ForgetfulStore(MemoryStore):
    """A backend that cannot keep records (a full disk, say); its contexts are saved."""

    async def put_records(
        self,
        records: Sequence[Record],
        ttl_s: float,
        keep_thread: str | None = None,
        keep: Sequence[tuple[str, str]] = (),
    ) -> int:
        raise StateUnavailable("the state backend is unreachable")


class StalledWrites(MemoryStore):
    """A backend whose record writes wait until `go` is set (a paused redis, say); `waiting`:
    the writes waiting now."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.waiting = 0

    async def put_records(
        self,
        records: Sequence[Record],
        ttl_s: float,
        keep_thread: str | None = None,
        keep: Sequence[tuple[str, str]] = (),
    ) -> int:
        self.waiting += 1
        try:
            await self.go.wait()
        finally:
            self.waiting -= 1
        return await super().put_records(records, ttl_s, keep_thread, keep)
