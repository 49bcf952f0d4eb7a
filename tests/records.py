"""One record put or deleted, as the tests write them (the store's calls take many at once)."""

from __future__ import annotations

from proxy.state.store import Record, StateStore


async def put_record(store: StateStore, kind: str, key: str, value: bytes, ttl_s: float) -> None:
    await store.put_records((Record(kind, key, value),), ttl_s)


async def delete_record(store: StateStore, kind: str, key: str) -> bool:
    """Whether there was such a record."""
    return await store.delete_records([(kind, key)]) == 1
