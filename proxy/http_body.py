"""An HTTP body read no further than a bound: what a server the proxy calls (a tool, a webhook)
answers is never held whole when it is larger than the proxy would use."""

from __future__ import annotations

import httpx


async def read_up_to(response: httpx.Response, cap: int) -> tuple[bytes, bool]:
    """At most the first `cap` bytes of the body, read as it streams in (never the whole of a
    larger one), and whether there was more."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(chunks)[:cap], True
    return b"".join(chunks), False


def declared_length(response: httpx.Response) -> int | None:
    value = response.headers.get("content-length", "")
    return int(value) if value.isdigit() else None
