"""Processes that start together (the workers of `serve --workers N`) open one new sqlite file
together: every one of them opens it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.e2e.conftest import ROOT

# Each process waits for the same instant, then opens the store and writes its name.
OPEN = textwrap.dedent(
    """
    import asyncio, sys, time
    from proxy.state.sqlite import SqliteStore
    from proxy.state.store import Record

    path, at, name = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    time.sleep(max(0.0, at - time.time()))
    store = SqliteStore(path, timeout_s=10.0)
    asyncio.run(store.put_records([Record("opened", name, b"1")], 60.0))
    print("opened", name)
    """
)


def test_workers_that_start_together_all_open_a_new_file(tmp_path: Path) -> None:
    path = tmp_path / "state" / "shared.db"
    for attempt in range(3):  # the race is the point: a few rounds of it
        at = time.time() + 1.5
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN, f"{path}-{attempt}", str(at), f"w{i}"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(6)
        ]
        outcomes = [p.communicate(timeout=30) for p in procs]
        for proc, (out, err) in zip(procs, outcomes, strict=True):
            assert proc.returncode == 0, err
            assert out.startswith("opened")
