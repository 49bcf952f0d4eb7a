"""The interpreter's settings once the server serves: its garbage collector, the GIL's switch
interval and the C allocator's threshold for large blocks."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

# The cyclic garbage collector, as it comes, scans the whole heap of start-up (the config, the
# tool schemas, the libraries' modules) again and again under load: measured, a fifth of the
# CPU. Once serving, that heap is frozen out of its scans, and the young generation collected
# every 20,000 net allocations rather than 700 (a run leaves no cycles behind: what it
# allocates is freed by reference counting; tests/integration/test_request_garbage.py).
GC_THRESHOLDS = (20_000, 10, 10)

# A thread running Python (a sync tool that computes, the span exporter encoding a batch) keeps
# the GIL until the interpreter's switch interval asks it to let go, and the event loop waits
# that long each time it wakes: with the default 5 ms, a tool thread spinning made each I/O
# round trip of the loop take 15 ms (p50); at 0.5 ms, 0.02 ms. Without such a thread the
# interval is never used.
SWITCH_INTERVAL_S = 0.0005


# glibc serves a block of 128 KiB and more from its own mapping, given back as it is freed,
# but raises that threshold (to 32 MiB) each time such a block is freed: after a burst of large
# requests the next ones come from its heap, which it keeps. Measured: 48 continuations of an
# 8 MB stored chain at once left RSS at 1 GB with 32,000 objects alive; with the threshold held
# at 256 KiB it fell back to 123 MB (and peaked lower).
MMAP_THRESHOLD = 256 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)


def settle_runtime() -> None:
    """Once serving: collects the garbage of start-up, keeps what is left out of later
    collections, shortens the GIL's switch interval, and holds glibc's threshold for large
    blocks where it stands."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    hold_mmap_threshold()


def hold_mmap_threshold() -> bool:
    """Large blocks from mappings of their own, given back as they are freed (glibc only):
    whether the C library took the setting."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # another C library, or none to load
        return False
