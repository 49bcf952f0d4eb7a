"""The interpreter's settings once the server serves: its garbage collector and the GIL's
switch interval."""

from __future__ import annotations

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


def settle_runtime() -> None:
    """Once serving: collects the garbage of start-up, keeps what is left out of later
    collections, and shortens the GIL's switch interval."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
