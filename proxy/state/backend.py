"""Opens the state backend the config names."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from proxy.config.environment import setting
from proxy.config.state import StateConfig
from proxy.state.sqlite_file import FileIdentity, file_identity
from proxy.state.store import StateStore


def check_state(config: StateConfig) -> None:
    """Raises ValueError, as `open_store` would, when a sqlite file cannot be opened (a
    directory, a file of something else, a folder that cannot be written): found before the
    proxy starts serving. Nothing stays open."""
    if config.backend != "sqlite" or config.path == ":memory:":
        return
    try:
        Path(config.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(config.path, timeout=config.timeout_s)
        try:
            db.execute("PRAGMA schema_version").fetchone()
        finally:
            db.close()
    except (sqlite3.Error, OSError) as exc:
        raise ValueError(f"state.path: cannot open {config.path!r}: {exc}") from None


def state_file(config: StateConfig) -> FileIdentity | None:
    """The identity of the sqlite file (made by `check_state`), for the workers of a server to
    open that one file or none; None for another backend."""
    if config.backend != "sqlite" or config.path == ":memory:":
        return None
    return file_identity(config.path)


def open_store(
    config: StateConfig,
    opened: FileIdentity | None = None,
    on_data_lost: Callable[[], None] = lambda: None,
) -> StateStore:
    """Raises ValueError when the backend cannot be set up from the config. `opened`: the
    sqlite file the server started with (`state_file`): when it is gone, it is not made anew.
    `on_data_lost`: told when redis is found to have lost the proxy's data."""
    if config.backend == "memory":
        from proxy.state.memory import MemoryStore

        return MemoryStore(context_ttl_s=config.context_ttl_s)
    if config.backend == "sqlite":
        from proxy.state.sqlite import SqliteStore

        try:
            return SqliteStore(
                config.path,
                timeout_s=config.timeout_s,
                lock_lease_s=config.lock_lease_s,
                journal=config.sqlite_journal,
                context_ttl_s=config.context_ttl_s,
                opened=opened,
            )
        except Exception as exc:  # sqlite3.Error or OSError: an unusable path
            raise ValueError(f"state.path: cannot open {config.path!r}: {exc}") from None
    from proxy.state.redis import RedisStore

    url = setting(config.url_env)
    if not url:
        raise ValueError(f"state.url_env: environment variable {config.url_env} is not set")
    return RedisStore(
        url,
        prefix=config.key_prefix,
        context_ttl_s=config.context_ttl_s,
        timeout_s=config.timeout_s,
        lock_lease_s=config.lock_lease_s,
        on_data_lost=on_data_lost,
    )
