"""Python callables named in the config as `package.module:function`, and the threads that the
sync ones run in.

A sync callable cannot be interrupted: one that hangs past its timeout keeps its thread until it
returns. In a pool the rest of the process shares (asyncio's default executor, the state
backend's thread), a few stuck tools would stall everything. `CallThreads` gives them a
bounded set of threads of their own: a call waits for one while others run calls that are
awaited, and fails at once when every thread is held by a call given up on, instead of queueing
behind the stuck ones. The threads are daemons: a callable that never returns does not
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
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


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
    """Every thread is busy with a call its caller gave up on: stuck callables."""


class CallRaised(Exception):
    """What a callable raised that may not reach the event loop as it is (`SystemExit`,
    `KeyboardInterrupt`, a `CancelledError` of its own, `StopIteration`, which a future cannot
    hold), carried as an ordinary failure that names it."""

    def __init__(self, raised: BaseException) -> None:
        said = str(raised)
        super().__init__(f"{type(raised).__name__}: {said}" if said else type(raised).__name__)


def ordinary(exc: BaseException) -> Exception:
    """`exc` when a callable's caller may be failed with it, else a CallRaised naming it."""
    if isinstance(exc, Exception) and not isinstance(exc, StopIteration):
        return exc
    return CallRaised(exc)


async def awaited(work: Awaitable[T]) -> T:
    """`await work` (an async callable's call): what it raises that would end more than the
    call (`SystemExit`, a cancellation of its own) is a CallRaised; a cancellation of the
    awaiting task stays one."""
    try:
        return await work
    except Exception:
        raise
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling():  # the caller is cancelled: not the callable's
            raise
        raise CallRaised(exc) from None
    except BaseException as exc:
        raise CallRaised(exc) from None


# Threads kept waiting for the next call once theirs returned: starting a thread per call cost
# a tool step more CPU than the rest of its work.
KEEP_IDLE = 8


class _Call:
    __slots__ = ("done", "given_up")

    def __init__(self) -> None:
        self.done = False  # its callable returned (set in its thread)
        self.given_up = False  # its caller stopped waiting before that (a timeout, a cancel)


class CallThreads:
    """At most `limit` sync calls at once, each in a daemon thread; a thread whose call
    returned waits for the next (up to KEEP_IDLE of them wait). A call waits for a thread, in
    turn, while any runs a call that its caller waits for; when every one holds a call given
    up on (stuck past its timeout), it fails at once (NoWorkerFree): stuck callables never
    make the others wait out their timeouts. What the threads hold is counted in them, so a
    call that outlives its event loop leaves no count behind."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._busy = 0  # threads running a call
        self._given_up = 0  # ... whose caller stopped waiting
        self._idle = 0  # threads waiting for a call
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], Callable[[], None]]] = queue.SimpleQueue()
        self._waiters: list[asyncio.Event] = []  # callers waiting for a thread, in turn

    @property
    def busy(self) -> int:
        """Threads running a call, including calls whose caller gave up on them."""
        return self._busy

    @property
    def idle(self) -> int:
        """Threads waiting for a call."""
        return self._idle

    async def run(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`func(*args, **kwargs)` in a thread, in the caller's context, once a thread is
        free; raises NoWorkerFree when every thread is stuck. What the callable raises that
        may not reach the event loop is a CallRaised (`ordinary`)."""
        await self._turn()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        context = contextvars.copy_context()
        call = _Call()

        def settle(ok: bool, value: Any) -> None:
            self._next()
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
                outcome = (False, ordinary(exc))
            with self._lock:
                call.done = True
                self._given_up -= call.given_up

            def deliver() -> None:
                # A closed loop raises RuntimeError: nobody waits for the result any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(settle, *outcome)

            return deliver

        try:
            self._start(work)
        except BaseException:
            self._next()
            raise
        try:
            return await future
        except asyncio.CancelledError:
            with self._lock:
                given_up = call.given_up = not call.done
                self._given_up += given_up
            if given_up:  # every thread may be stuck now: the waiters fail at once
                for turn in self._waiters:
                    turn.set()
            raise

    async def _turn(self) -> None:
        """Returns once this call may take a thread: one is free and no caller waits ahead."""
        if self._busy < self.limit and not self._waiters:
            return
        turn = asyncio.Event()
        self._waiters.append(turn)
        try:
            while not (self._waiters[0] is turn and self._busy < self.limit):
                with self._lock:
                    stuck = self._busy >= self.limit and self._given_up >= self._busy
                if stuck:
                    raise NoWorkerFree(
                        f"no tool worker free: all {self.limit} tool threads are busy with "
                        "calls that have not returned (server.tool_threads)"
                    )
                turn.clear()
                await turn.wait()
        finally:
            self._waiters.remove(turn)
            self._next()

    def _next(self) -> None:
        """A thread may have come free: the first caller in turn looks again."""
        if self._waiters:
            self._waiters[0].set()

    def _start(self, work: Callable[[], Callable[[], None]]) -> None:
        with self._lock:
            self._busy += 1
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that one takes this call
        if start:
            try:
                threading.Thread(target=self._serve, name="loopwarden-call", daemon=True).start()
            except BaseException:
                with self._lock:
                    self._busy -= 1
                raise
        self._calls.put(work)

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


def is_async(func: Callable[..., Any]) -> bool:
    """An `async def` function, a `functools.partial` of one, or an object whose `__call__` is
    one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


async def call(func: Callable[..., Any], threads: CallThreads, /, *args: Any, **kwargs: Any) -> Any:
    """Awaits an async callable; runs a sync one in one of `threads`, off the event loop."""
    if is_async(func):
        return await awaited(func(*args, **kwargs))
    return await threads.run(func, *args, **kwargs)
