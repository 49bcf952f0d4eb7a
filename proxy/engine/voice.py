"""What a run's observers and its stream hear, in order."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from proxy.engine import events as ev
from proxy.engine.ports import RunObserver, RunStream
from proxy.engine.values import PART_BREAK, DeltaSink

log = logging.getLogger(__name__)


class Voice:
    """Tells observers every event (an observer that raises is logged: telemetry never breaks a
    run) and the stream, when there is one, the progress and the text the client sees."""

    def __init__(
        self, observers: Sequence[RunObserver], stream: RunStream | None, quiet: bool = False
    ) -> None:
        """`quiet`: no text reaches the stream (a reply that is one JSON document is sent
        whole at the end, by the stream's owner); the upstream's answer still starts it."""
        self.observers = observers
        self.stream = stream
        self.quiet = quiet
        self._streamed = False  # whether any text reached the stream yet
        self.parts = 0  # the parts of the reply (a step's text each) streamed so far

    def notify(self, event: ev.RunEvent) -> None:
        for observer in self.observers:
            try:
                observer.on_event(event)
            except Exception:
                log.exception("observer %r failed on %s", observer, type(event).__name__)

    async def emit(self, event: ev.RunEvent) -> None:
        self.notify(event)
        if self.stream is not None:
            await self.stream.progress(event)

    async def say(self, text: str) -> None:
        """Streams text that starts a new part of the reply: parts are separated by a blank
        line (SPEC §4.3)."""
        if self.stream is None or not text or self.quiet:
            return
        if self._streamed:
            text = PART_BREAK + text
        self._streamed = True
        self.parts += 1
        await self.stream.content(text)

    def step_sink(self) -> DeltaSink | None:
        """Where one step's answer goes: its first text starts a part, the rest continue it."""
        if self.stream is None:
            return None
        return _StepSink(self, self.stream)


class _StepSink:
    __slots__ = ("first", "stream", "voice")

    def __init__(self, voice: Voice, stream: RunStream) -> None:
        self.voice = voice
        self.stream = stream
        self.first = True

    async def begin(self, head: Mapping[str, str], text: str) -> None:
        self.stream.heard(head)
        if text and not self.voice.quiet:
            await self(text)
        else:  # the answer has begun, but has nothing to say yet (or says it at the end)
            await self.stream.begin()

    async def __call__(self, text: str) -> None:
        if self.voice.quiet:
            return
        if self.first:
            self.first = False
            await self.voice.say(text)
        else:
            await self.stream.content(text)
