"""Python callables named in the config as `package.module:function`, and the threads that the
sync ones run in.

A sync callable cannot be interrupted: one that hangs past its timeout keeps its thread until it
returns. In a pool the rest of the process shares (asyncio's default executor, the state
backend's thread), a few stuck tools would stall everything. `CallThreads` gives them a
bounded set of threads of their own, and a call that finds none free fails at once instead of
queueing behind the stuck ones. The threads are daemons: a callable that never returns does not
keep the process from exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import inspect
import queue
import threading
from collections.abc import Callable
from typing import Any


def load_callable(ref: str) -> Callable[..., Any]:
    """`package.module:function` -> the function; raises ValueError with the reason."""
    module_name, _, attr = ref.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ValueError(f"{ref!r} is not callable")
    return target  # type: ignore[no-any-return]


class NoWorkerFree(Exception):
    """Every thread is busy with a call that has not returned: slow or stuck callables."""


# Threads kept waiting for the next call once theirs returned: starting a thread per call cost
# a tool step more CPU than the rest of its work.
KEEP_IDLE = 8


class CallThreads:
    """At most `limit` sync calls at once, each in a daemon thread; a thread whose call
    returned waits for the next (up to KEEP_IDLE of them wait)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._busy = 0
        self._idle = 0  # threads waiting for a call
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], Callable[[], None]]] = queue.SimpleQueue()

    @property
    def busy(self) -> int:
        """Threads running a call, including calls whose caller gave up on them."""
        return self._busy

    @property
    def idle(self) -> int:
        """Threads waiting for a call."""
        return self._idle

    async def run(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`func(*args, **kwargs)` in a thread, in the caller's context; raises NoWorkerFree
        when `limit` calls are still running."""
        with self._lock:
            if self._busy >= self.limit:
                raise NoWorkerFree(
                    f"no tool worker free: all {self.limit} tool threads are busy with calls "
                    "that have not returned (server.tool_threads)"
                )
            self._busy += 1
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that one takes this call
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        context = contextvars.copy_context()

        def settle(ok: bool, value: Any) -> None:
            if future.done():  # the caller gave up on it (a timeout, a cancelled run)
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def work() -> Callable[[], None]:
            outcome: tuple[bool, Any]
            try:
                outcome = (True, context.run(func, *args, **kwargs))
            except BaseException as exc:
                outcome = (False, exc)

            def deliver() -> None:
                # A closed loop raises RuntimeError: nobody waits for the result any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(settle, *outcome)

            return deliver

        if start:
            try:
                threading.Thread(target=self._serve, name="loopwarden-call", daemon=True).start()
            except BaseException:
                with self._lock:
                    self._busy -= 1
                raise
        self._calls.put(work)
        return await future

    def _serve(self) -> None:
        while True:
            deliver = self._calls.get()()
            with self._lock:  # free (and waiting, if kept) before the caller hears back
                self._busy -= 1
                keep = self._idle < KEEP_IDLE
                self._idle += keep
            deliver()
            if not keep:
                return


async def call(func: Callable[..., Any], threads: CallThreads, /, *args: Any, **kwargs: Any) -> Any:
    """Awaits an async callable; runs a sync one in one of `threads`, off the event loop."""
    if inspect.iscoroutinefunction(func):
        return await func(*args, **kwargs)
    return await threads.run(func, *args, **kwargs)
