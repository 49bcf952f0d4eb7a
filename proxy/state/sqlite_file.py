"""Which file a sqlite path names: one deleted or replaced under a process is noticed, and a
worker that replaces another opens the file the server started with, or none."""

from __future__ import annotations

import os

FileIdentity = tuple[int, int]  # device and inode


def file_identity(path: str) -> FileIdentity:
    """Raises OSError when there is no such file."""
    found = os.stat(path)
    return found.st_dev, found.st_ino


def current(path: str) -> FileIdentity | None:
    """The identity of the file at `path` now; None when there is none."""
    try:
        return file_identity(path)
    except OSError:
        return None
