"""Large JSON texts are parsed one at a time in a process: request bodies, stored records,
upstream replies and an upstream stream's events.

Parsing holds the event loop: orjson takes ~2 ms a MiB of prose and far longer for many small
values, and counting a text's values first (`proxy.json_values`) takes a thread the GIL. Each
parse is bounded, but requests that parse at once would hold the loop for the sum of theirs:
48 small requests continuing one 7 MiB stored conversation held every other request for more
than a second. A text of LARGE_TEXT bytes or more is counted and parsed in its turn, in the
order the turns were asked for; smaller ones never wait. A task already holding the turn does
not wait for it again. After a text of PAUSE_AFTER bytes or more, the task waits a turn of the
loop before going on with what it parsed (tens of milliseconds more, for a long text), so that
the requests waiting meanwhile are served first.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import weakref
from collections.abc import AsyncIterator

LARGE_TEXT = 64 * 1024
PAUSE_AFTER = 1 << 20

_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)
_HOLDING = contextvars.ContextVar("holding_parse_turn", default=False)


def parse_turn(size: int) -> contextlib.AbstractAsyncContextManager[None]:
    """Waits for the loop's parse turn when `size` bytes are LARGE_TEXT or more, and holds it
    for the block (which parses, and should not wait on anything else)."""
    if size < LARGE_TEXT or _HOLDING.get():
        return _NO_WAIT
    return _turn(size)


class _NoWait:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *_: object) -> None:
        return None


_NO_WAIT = _NoWait()


@contextlib.asynccontextmanager
async def _turn(size: int) -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    turn = _TURNS.get(loop)
    if turn is None:
        turn = _TURNS[loop] = asyncio.Lock()
    async with turn:
        holding = _HOLDING.set(True)
        try:
            yield
        finally:
            _HOLDING.reset(holding)
    if size >= PAUSE_AFTER:
        await asyncio.sleep(0)
