"""What a run's observers and its stream hear, in order."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from proxy.engine import events as ev
from proxy.engine.ports import RunObserver, RunStream
from proxy.engine.values import DeltaSink

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
            text = "\n\n" + text
        self._streamed = True
        await self.stream.content(text)

    def step_sink(self) -> DeltaSink | None:
        """Where one step's text deltas go: the first starts a part, the rest continue it."""
        stream = self.stream
        if stream is None:
            return None
        if self.quiet:
            return _beginning(stream)
        first = True

        async def sink(text: str) -> None:
            nonlocal first
            if not text:
                await stream.begin()
            elif first:
                first = False
                await self.say(text)
            else:
                await stream.content(text)

        return sink


def _beginning(stream: RunStream) -> DeltaSink:
    """A step's sink that only starts the stream: its text is not sent."""

    async def sink(text: str) -> None:
        await stream.begin()

    return sink
