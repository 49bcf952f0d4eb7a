"""`state`: where contexts, run reports and stored responses are kept, and for how long."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.config.environment import EnvName
from proxy.config.model import ConfigModel


class StateConfig(ConfigModel):
    backend: Literal["memory", "sqlite", "redis"] = "sqlite"
    path: str = "./loopwarden.db"
    url_env: EnvName = "REDIS_URL"
    key_prefix: str = "loopwarden:"  # redis
    # A context ends this long after it was last saved (None: never).
    context_ttl_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    # A thread's tool call counts (SPEC §9) end this long after its last counted call (None:
    # never); a chain of stored responses keeps its thread's as long as its responses.
    thread_ttl_s: float | None = Field(30 * 86400.0, gt=0, allow_inf_nan=False)
    # Run reports (GET /v1/runs/{id}) and held server calls (SPEC §5.1.6) are kept this long.
    run_ttl_s: float = Field(86400.0, gt=0, allow_inf_nan=False)
    # Stored responses (`/v1/responses` with `store`, SPEC §12.4) are kept this long.
    response_ttl_s: float = Field(30 * 86400.0, gt=0, allow_inf_nan=False)
    # Stored responses written as the version before conversations in parts and outputs records
    # wrote them (each conversation whole), so that its replicas read and delete them whole: on
    # for a rolling upgrade from it, off once every replica runs this one.
    rolling_upgrade: bool = False
    # The longest one call to the backend may wait (redis socket timeouts, sqlite's busy
    # timeout, the /readyz check) before it fails with 503 state_unavailable.
    timeout_s: float = Field(5.0, gt=0, le=300, allow_inf_nan=False)
    # A run holds its context by a lease this long (sqlite, redis), renewed every third of it:
    # a crashed process frees its contexts within one lease.
    lock_lease_s: float = Field(30.0, ge=1, le=86400, allow_inf_nan=False)
    # sqlite: `wal` (fast: no fsync per write) shares memory between processes through a mapped
    # `-shm` file, which kills the process (SIGBUS) if that file is made immutable under it;
    # `rollback` maps nothing, so any fault of the file is a 503, at an fsync per write.
    sqlite_journal: Literal["wal", "rollback"] = "wal"
    # The most a stored context may hold: the JSON of its messages, in bytes.
    max_context_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # The longest context id; ids are also refused when empty, with '/' or control characters.
    max_context_id_chars: int = Field(256, ge=1, le=4096)
