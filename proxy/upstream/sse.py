"""Server-sent events: the `data:` payloads of a byte stream."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator


async def sse_data(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Yields each event's data (multi-line data joined with newlines), `[DONE]` included."""
    buffer = b""
    data: list[bytes] = []
    async for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line:
                if data:
                    yield b"\n".join(data)
                    data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(b" ") else value)
    tail = buffer.rstrip(b"\r")
    if tail.startswith(b"data:"):
        value = tail[5:]
        data.append(value[1:] if value.startswith(b" ") else value)
    if data:
        yield b"\n".join(data)
