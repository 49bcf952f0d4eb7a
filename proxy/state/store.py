"""The state port: thread counters (SPEC §9) and stored contexts (SPEC §10)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import orjson

from proxy.errors import StateUnavailable

log = logging.getLogger(__name__)

P = TypeVar("P")
RECORDS_AT_ONCE = 100  # the most records one `put_records` writes, or `get_records` reads


class Record(NamedTuple):
    """A record to put: its kind, its key (no two (kind, key) pairs share one) and its value."""

    kind: str
    key: str
    value: bytes


@dataclass(slots=True)
class StoredContext:
    """A server-side conversation: its agent or model, the key that owns it (None when it was
    created without proxy keys) and its messages in OpenAI shape.

    `version` is the version of the stored copy this one was read from (0: never stored); a save
    succeeds only while the stored copy is still that one (compare-and-set), and bumps it."""

    id: str
    agent: str | None = None
    model: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    updated: int = field(default_factory=lambda: int(time.time()))
    owner: str | None = None
    version: int = 0
    # The thread of its tool call limits, when not its id (with proxy keys, in its owner's
    # namespace; contexts stored before this was kept use their id).
    thread: str | None = None

    @property
    def thread_id(self) -> str:
        return self.thread or self.id

    @property
    def name(self) -> str:
        """Its id as its client names it: one kept in its key's namespace is `<key>/<name>`
        (a name has no `/`)."""
        return self.id.partition("/")[2] or self.id

    def dumps(self, version: int) -> bytes:
        """The stored form, as `version`. The version comes first, so a backend can read it
        from the first bytes (redis)."""
        return orjson.dumps(
            {
                "version": version,
                "id": self.id,
                "agent": self.agent,
                "model": self.model,
                "owner": self.owner,
                "created": self.created,
                "updated": self.updated,
                **({"thread": self.thread} if self.thread is not None else {}),
                "messages": self.messages,
            }
        )

    @classmethod
    def loads(cls, data: bytes | str) -> StoredContext:
        fields = orjson.loads(data)
        fields.setdefault("version", 1)  # stored before contexts had versions
        # A field a later version added is left out: a replica not yet upgraded reads its
        # contexts all the same.
        return cls(**{name: fields[name] for name in _CONTEXT_FIELDS if name in fields})


_CONTEXT_FIELDS = tuple(f.name for f in dataclasses.fields(StoredContext))


def conflict(context_id: str) -> StateUnavailable:
    """The error of a save that lost the race: another run saved the context since it was read
    (this run's hold on it was lost, e.g. its lease expired), or it was deleted."""
    name = context_id.partition("/")[2] or context_id  # as its client names it
    return StateUnavailable(
        f"context {name!r} was changed or deleted by another request while this run held "
        "it (its lock was lost); this run's messages were not saved"
    )


class Holding(Protocol):
    """A context held (`StateStore.hold`)."""

    @property
    def context(self) -> StoredContext | None:
        """The context as it was stored when the hold was taken; None when there was none."""
        ...

    async def end(
        self, save: StoredContext | None, records: Sequence[Record], ttl_s: float
    ) -> None:
        """The hold's last write, in one call where the backend allows: `save` (when one is
        given) stored as `save_context` stores it, `records` put for `ttl_s` as `put_records`
        puts them, and the hold let go. Raises `StateUnavailable` when the save is refused
        (`conflict`), which wrote nothing, or the backend fails before it is known to be made
        (the hold ends with its block then); records that fail after the save was made are
        logged, not raised: the save stands."""
        ...


@dataclass(slots=True)
class Held:
    """The hold of a backend whose calls are no round trips (this process's memory): its last
    write is a save (by `saving`, else `save_context`) and a put, and it is let go as its block
    ends."""

    store: StateStore
    context: StoredContext | None
    saving: Callable[[StoredContext], Awaitable[None]] | None = None

    async def end(
        self, save: StoredContext | None, records: Sequence[Record], ttl_s: float
    ) -> None:
        if save is not None:
            await (self.saving or self.store.save_context)(save)
        if not records:
            return
        try:
            await self.store.put_records(records, ttl_s)
        except StateUnavailable as exc:
            if save is None:
                raise
            log.warning("context %r was saved, but its run's records were not: %s", save.id, exc)


class StateStore(Protocol):
    """Every method raises `StateUnavailable` when the backend fails or cannot be trusted."""

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int], ttl_s: float | None = None
    ) -> tuple[bool, dict[str, int]]:
        """Atomically: when every counter is below its limit, add one to each. With `ttl_s`,
        the thread's counters are dropped once `ttl_s` passed without a reservation or a
        `keep_thread` (a thread only a chain of stored responses can reach); without, they
        are kept for good (SPEC §9)."""
        ...

    async def thread_counts(self, thread_id: str) -> dict[str, int]: ...

    async def release(self, thread_id: str, counts: Mapping[str, int]) -> None:
        """Takes `counts` from the counters, none below 0 (calls reserved for that never
        ran)."""
        ...

    async def load_context(self, context_id: str) -> StoredContext | None: ...

    async def save_context(self, context: StoredContext) -> None:
        """Stores `context` when the stored copy is still the version it was read from (none,
        for version 0), and sets `context.version` to the new one; raises `StateUnavailable`
        (`conflict`) and stores nothing otherwise."""
        ...

    async def delete_context(self, context_id: str) -> bool:
        """Drops the context (its thread counters stay, so limits cannot be reset by a
        delete); False when there was none."""
        ...

    async def put_records(
        self,
        records: Sequence[Record],
        ttl_s: float,
        keep_thread: str | None = None,
        keep: Sequence[tuple[str, str]] = (),
    ) -> int:
        """Stores each record for `ttl_s` seconds, replacing what was there (its TTL included),
        for every process sharing the backend: all in one write, in their order (put the
        record that names the others last: a reader that finds it finds them). With
        `keep_thread`, that thread's counters end `ttl_s` from now, in the same write where the
        backend allows (sqlite keeps it just before, on its own), unless reserved or kept again
        later (nothing for a thread without counters, or whose end has passed). The records
        `keep` names, as (kind, key) pairs, end `ttl_s` from now too, alike (nothing for a
        record that is not there): gives how many of them were there. Raises ValueError unless
        `ttl_s` is positive and finite and there are at most RECORDS_AT_ONCE records, and as
        many kept."""
        ...

    async def get_record(self, kind: str, key: str) -> bytes | None:
        """The value, or None when there is none or it has expired."""
        ...

    async def get_records(
        self, wanted: Sequence[tuple[str, str]], max_bytes: int | None = None
    ) -> list[bytes | None]:
        """The values of the (kind, key) pairs `wanted`, in their order, as `get_record` finds
        each, in one read. With `max_bytes`, of the first pairs only, whose values add up to
        at most that many bytes (the first, whatever its size): a shorter list, the pairs after
        it not read. Raises ValueError past RECORDS_AT_ONCE pairs."""
        ...

    async def delete_records(self, wanted: Sequence[tuple[str, str]]) -> int:
        """Drops the records of these (kind, key) pairs in one call; how many there were.
        Raises ValueError past RECORDS_AT_ONCE pairs."""
        ...

    def hold(self, context_id: str) -> AbstractAsyncContextManager[Holding]:
        """Serialises the runs on one context, between every process sharing the backend, and
        reads the context as the hold is taken. The hold is a lease, renewed while it is held:
        when it is lost all the same (the process stalled longer than the lease), the holder's
        save fails instead of overwriting the next holder's."""
        ...

    async def ping(self) -> None:
        """Raises `StateUnavailable` when the backend cannot be reached or written."""
        ...

    async def close(self) -> None: ...


def first_within(sizes: Sequence[int], max_bytes: int | None) -> int:
    """How many of the first records, of these sizes, `get_records` reads within `max_bytes`:
    those that add up to at most that many, and the first whatever its size."""
    total = 0
    for count, size in enumerate(sizes):
        total += size
        if count and max_bytes is not None and total > max_bytes:
            return count
    return len(sizes)


def check_put(
    records: Sequence[Record], ttl_s: float, keep: Sequence[tuple[str, str]] = ()
) -> float:
    """`ttl_s`, when `records` may be put for that long, and `keep` kept as long; raises
    ValueError otherwise."""
    check_at_once(records)
    if keep:
        check_at_once(keep)
    return check_ttl(ttl_s)


def check_at_once(records: Sequence[object]) -> None:
    """Raises ValueError when one call may not write or read so many records."""
    if len(records) > RECORDS_AT_ONCE:
        raise ValueError(f"at most {RECORDS_AT_ONCE} records at once, not {len(records)}")


def check_ttl(ttl_s: float) -> float:
    """`ttl_s`, when a record may be kept that long; raises ValueError otherwise."""
    if not (0 < ttl_s < math.inf):  # also refuses NaN
        raise ValueError(f"a record's TTL must be a positive number of seconds, not {ttl_s!r}")
    return ttl_s


def batches(puts: Sequence[P], size: Callable[[P], int], most: int) -> Iterator[list[P]]:
    """The puts of a group commit in order, in batches whose sizes add up to at most `most`
    (a put larger than that in a batch of its own: a put is never split)."""
    batch: list[P] = []
    total = 0
    for put in puts:
        grown = total + size(put)
        if batch and grown > most:
            yield batch
            batch, grown = [], size(put)
        batch.append(put)
        total = grown
    if batch:
        yield batch


def settle(
    waiting: list[asyncio.Future[int]], error: BaseException | None, kept: Sequence[int] = ()
) -> None:
    """Ends the writes of a batch (group commit): each with the batch's error, if any, as a copy
    of its own, else with how many of the records it keeps were there (`kept`, in order)."""
    for at, future in enumerate(waiting):
        if future.done():  # its put was cancelled
            continue
        if error is None:
            future.set_result(kept[at] if at < len(kept) else 0)
        else:
            future.set_exception(copy.copy(error))
