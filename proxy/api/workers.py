"""`loopwarden serve --workers N`: N worker processes behind one listening socket.

The supervisor binds the socket, points prometheus-client's multiprocess mode at a directory
of its own (emptied at start, removed at exit), then forks the workers; each builds its own app
after the fork and serves the shared socket, so the kernel spreads connections over them. A
worker that dies is replaced (its live gauges are dropped from `/metrics`); one that cannot
start (its lifespan failed) stops them all, since the next would fail the same way, unless it
had served: a replacement that cannot start (its state file unwritable for now, say) is tried
again, each time later (at most six times in a row, then the server stops). SIGTERM or
SIGINT stops every worker gracefully.

State that runs share must be shared by the workers: the config check refuses the memory
backend with more than one worker (thread limits and stored contexts would be per process).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from proxy.telemetry.metrics import MULTIPROC_ENV

log = logging.getLogger(__name__)

NOT_STARTED = 3  # a worker's exit status when its app did not start
STOPS = {signal.SIGTERM, signal.SIGINT}
# The longest a worker that replaced another and could not start waits before the next try,
# and the tries in a row before the server stops (2 + 4 + 8 + 16 + 30 + 30 s: 90 s).
MAX_RESTART_WAIT_S = 30.0
MAX_START_TRIES = 6
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def metrics_directory() -> Path:
    """The directory the workers write their metrics to: `PROMETHEUS_MULTIPROC_DIR` when it is
    set (emptied of what an earlier run left), else a fresh temporary one."""
    configured = os.environ.get(MULTIPROC_ENV)
    if configured:
        folder = Path(configured)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.db"):
            stale.unlink()
        return folder
    folder = Path(tempfile.mkdtemp(prefix="loopwarden-metrics-"))
    os.environ[MULTIPROC_ENV] = str(folder)
    return folder


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def restart_wait_s(tries: int) -> float:
    """How long a replacement waits after `tries` replacements in a row that did not start."""
    return min(2.0**tries, MAX_RESTART_WAIT_S)


def supervise(
    workers: int,
    sock: socket.socket,
    work: Callable[[socket.socket], bool],
    waits: Callable[[int], float] = restart_wait_s,
) -> int:
    """Forks `workers` processes that each run `work(sock)` (False: it did not start), replaces
    any that dies (one that cannot start after `waits(tries)`), and stops them all on SIGTERM
    or SIGINT. Returns the exit status."""
    folder = metrics_directory()
    supervisor = os.getpid()
    children: dict[int, int] = {}  # pid -> worker number
    stopping = False
    failed = False

    def start(number: int, after_s: float = 0.0) -> None:
        """Forks worker `number`, which starts after `after_s`. Called with SIGTERM and SIGINT
        held (`_signals_held`): a stop told between the check of `stopping` and the fork
        closed the socket the worker was given."""
        pid = os.fork()
        if pid == 0:  # the worker
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
            _stop_with(supervisor)
            _use_multiprocess_values()
            code = 1
            try:
                time.sleep(after_s)
                code = 0 if work(sock) else NOT_STARTED
            except SystemExit:  # uvicorn's answer to a lifespan that failed
                code = NOT_STARTED
            except BaseException:
                log.exception("worker %d failed", number)
            os._exit(code)
        children[pid] = number

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        # The workers close their copies of the socket as they begin to drain: the port then
        # refuses connections, unless this one, left open, let the kernel take them for no
        # one (each hung until the drain ended).
        sock.close()
        for pid in children:
            _signal(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    address = sock.getsockname()
    with _signals_held():
        for number in range(workers):
            start(number)
    log.info("serving with %d workers on %s", workers, address)
    served: set[int] = set()  # the workers that started once: a replacement may not, for now
    unstarted: dict[int, int] = {}  # replacements of a worker in a row that did not start
    try:
        while children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries os.wait itself
                continue
            if pid not in children:
                continue
            number = children.pop(pid)
            _mark_dead(pid)
            code = os.waitstatus_to_exitcode(status)
            with _signals_held():
                if stopping:
                    continue
                tries = unstarted[number] = (
                    unstarted.get(number, 0) + 1 if code == NOT_STARTED else 0
                )
                # At the server's start the next would fail the same way; past MAX_START_TRIES
                # it has been down for minutes: the orchestrator is told.
                if tries and (number not in served or tries > MAX_START_TRIES):
                    log.error("worker %d could not start (%d in a row); stopping", number, tries)
                    failed = True
                    stop(signal.SIGTERM, None)
                    continue
                if tries:  # the others serve: it is tried again, less often
                    after_s = waits(tries)
                    said = "worker %d could not start again; another tries in %g s"
                    log.error(said, number, after_s)
                    start(number, after_s)
                    continue
                served.add(number)
                log.error(
                    "worker %d (pid %d) exited with %d; starting another", number, pid, status
                )
                start(number)
    finally:
        sock.close()
        if os.environ.get(MULTIPROC_ENV) == str(folder) and folder.name.startswith("loopwarden-"):
            shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed else 0


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT wait until the block ends (then `stop` runs)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)


def _stop_with(supervisor: int) -> None:
    """A worker is told to stop (SIGTERM) when its supervisor dies, however it dies (SIGKILL,
    the OOM killer): else it would go on serving the port, with no one to replace it, and keep
    a new `serve` from binding it. Linux only (prctl); elsewhere a supervisor killed outright
    leaves its workers to be stopped by hand."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:  # pragma: no cover
        log.warning("workers will outlive a supervisor killed outright: prctl failed")
    if os.getppid() != supervisor:  # it died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def _use_multiprocess_values() -> None:
    """Metrics created from now on write to the shared directory, even where prometheus-client
    was imported before the directory was set."""
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


def _mark_dead(pid: int) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
