"""Server-sent events: the `data:` payloads of a byte stream."""

from __future__ import annotations


class SSEDecoder:
    """Feeds on bytes as they arrive; returns each complete event's data (multi-line data
    joined with newlines). `done` turns true at `data: [DONE]`, which is not returned."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []
        self.done = False

    def feed(self, chunk: bytes) -> list[bytes]:
        events: list[bytes] = []
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
        if events and events[-1] == b"[DONE]":
            self.done = True
            events.pop()
        return events
