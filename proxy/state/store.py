"""The state port: thread counters (SPEC §9) and stored contexts (SPEC §10)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import orjson


@dataclass(slots=True)
class StoredContext:
    """A server-side conversation: its agent or model and its messages in OpenAI shape."""

    id: str
    agent: str | None = None
    model: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    updated: int = field(default_factory=lambda: int(time.time()))

    def dumps(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, data: bytes | str) -> StoredContext:
        return cls(**orjson.loads(data))


class StateStore(Protocol):
    async def reserve(
        self, thread_id: str, limits: Mapping[str, int]
    ) -> tuple[bool, dict[str, int]]:
        """Atomically: when every counter is below its limit, add one to each."""
        ...

    async def thread_counts(self, thread_id: str) -> dict[str, int]: ...

    async def load_context(self, context_id: str) -> StoredContext | None: ...

    async def save_context(self, context: StoredContext) -> None: ...

    async def delete_context(self, context_id: str) -> bool:
        """Drops the context (its thread counters stay, so limits cannot be reset by a
        delete); False when there was none."""
        ...

    async def put_record(self, kind: str, key: str, value: bytes, ttl_s: float) -> None:
        """Stores `value` under (kind, key) for `ttl_s` seconds, replacing what was there (its
        TTL included), for every process sharing the backend. No two (kind, key) pairs share a
        record, whatever ':' either holds. Raises ValueError unless `ttl_s` is positive and
        finite."""
        ...

    async def get_record(self, kind: str, key: str) -> bytes | None:
        """The value, or None when there is none or it has expired."""
        ...

    async def delete_record(self, kind: str, key: str) -> bool:
        """Drops it; False when there was none (or it had expired)."""
        ...

    def hold(self, context_id: str) -> AbstractAsyncContextManager[None]:
        """Serialises the runs on one context."""
        ...

    async def ping(self) -> None:
        """Raises when the backend cannot be reached."""
        ...

    async def close(self) -> None: ...


def check_ttl(ttl_s: float) -> float:
    """`ttl_s`, when a record may be kept that long; raises ValueError otherwise."""
    if not (0 < ttl_s < math.inf):  # also refuses NaN
        raise ValueError(f"a record's TTL must be a positive number of seconds, not {ttl_s!r}")
    return ttl_s
