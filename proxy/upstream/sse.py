"""Server-sent events: the `data:` payloads of a byte stream."""

from __future__ import annotations

COLON = ord(":")  # a line that begins with it is a comment
BOM = b"\xef\xbb\xbf"  # a stream may begin with it: no part of its first line


class EventTooLarge(ValueError):
    """One event (or one line of it) grew past the decoder's `max_event_bytes`."""


class ErrorEvent(ValueError):
    """An event of type `error` (`event: error`); its data is the argument."""


class SSEDecoder:
    """Feeds on bytes as they arrive; returns each complete event's data (multi-line data
    joined with newlines). `done` turns true at `data: [DONE]`, which is not returned, and
    nothing after it is read.

    Fails (`failure`, and `done`) as soon as the event being read (its data and the line not
    yet ended) holds more than `max_event_bytes` (EventTooLarge: a stream without line breaks
    cannot grow it without bound), or at an event of type `error` (ErrorEvent). The events
    before the failure are returned first, however the stream's reads fell. A line arriving
    in many pieces is joined once, when it ends."""

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._pieces: list[bytes] = []  # the line not yet ended
        self._pieces_size = 0
        self._data: list[bytes] = []
        self._data_size = 0
        self._error = False  # the event being read is of type `error`
        self.max_event_bytes = max_event_bytes
        self.done = False
        self.failure: EventTooLarge | ErrorEvent | None = None
        self._begun = False  # bytes came: a BOM is looked for in the first

    @property
    def held(self) -> int:
        """The bytes of an event begun and not ended: with the next read's, the most an event
        that read ends may hold."""
        return self._pieces_size + self._data_size

    def feed(self, chunk: bytes) -> list[bytes]:
        events: list[bytes] = []
        if self.done:
            return events
        if not self._begun and chunk:
            self._begun = True
            chunk = chunk.removeprefix(BOM)  # (its first event was dropped as no `data:` line)
        try:
            self._feed(chunk, events)
        except (EventTooLarge, ErrorEvent) as exc:
            self.failure, self.done = exc, True
        return events

    def _feed(self, chunk: bytes, events: list[bytes]) -> None:
        if b"\n" not in chunk:
            self._pieces.append(chunk)
            self._pieces_size += len(chunk)
            self._check()
            return
        if self._pieces:
            chunk = b"".join([*self._pieces, chunk])
        if not self._data and not self._error and b"\n\n" in chunk and b"\r" not in chunk:
            # Whole events, as upstreams send them: one split, and a `data: ` line alone
            # taken as it is; any other event is read line by line.
            *blocks, chunk = chunk.split(b"\n\n")
            for block in blocks:
                if not block or (block[0] == COLON and b"\n" not in block):
                    continue  # a blank line, or a comment alone: no event (a stream of them
                    # made a read of a megabyte a third of a second of lines read one by one)
                if block.startswith(b"data: ") and b"\n" not in block:
                    self._event(block[6:], events)
                else:
                    self._lines(block + b"\n\n", events)
                if self.done:
                    return
            if not chunk:  # it ended with an event, as a read mostly does
                self._pieces, self._pieces_size = [], 0
                return
        self._lines(chunk, events)

    def _lines(self, text: bytes, events: list[bytes]) -> None:
        """Reads each line `text` ends; the rest waits for the line's end."""
        *lines, rest = text.split(b"\n")
        self._pieces = [rest] if rest else []
        self._pieces_size = 0  # the lines before it are no part of the event `rest` is in
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line:
                error, self._error = self._error, False
                if not self._data:
                    continue
                data = b"\n".join(self._data)
                self._data, self._data_size = [], 0
                if error:
                    raise ErrorEvent(data)
                self._event(data, events)
                if self.done:
                    return
            elif line.startswith(b"data:"):
                value = line[5:]
                value = value[1:] if value.startswith(b" ") else value
                self._data_size += len(value) + (1 if self._data else 0)  # (the line break
                self._data.append(value)  # that joins it to the one before, when there is one)
                self._check()
            elif line.startswith(b"event:"):
                self._error = line[6:].strip() == b"error"
        self._pieces_size = len(rest)
        self._check()

    def _event(self, data: bytes, events: list[bytes]) -> None:
        if data == b"[DONE]":
            self.done = True
        elif self.max_event_bytes is not None and len(data) > self.max_event_bytes:
            raise EventTooLarge(f"an event of more than {self.max_event_bytes} bytes")
        else:
            events.append(data)

    def _check(self) -> None:
        limit = self.max_event_bytes
        if limit is not None and self._data_size + self._pieces_size > limit:
            raise EventTooLarge(f"an event of more than {limit} bytes")
