"""Requests made straight to an ASGI app, as a server makes them: no HTTP client in between,
every message the app sends kept."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Message, Receive


def post_scope(path: str) -> dict[str, Any]:
    """The scope of a JSON POST to `path`."""
    return {
        "type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "http_version": "1.1", "scheme": "http",
        "headers": [(b"content-type", b"application/json")],
        "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
    }  # fmt: skip


def body_then_stay(body: bytes) -> Receive:
    """A client that sends `body` whole, then stays connected."""
    received = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if received:
            return received.pop()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return receive
