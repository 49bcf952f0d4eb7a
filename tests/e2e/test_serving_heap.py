"""A serving process keeps the heap of its start-up out of the garbage collector's scans, which
otherwise took a fifth of the CPU under load, and shortens the GIL's switch interval, which
otherwise let any busy thread hold the event loop up 5 ms at each of its wake-ups."""

from __future__ import annotations

import gc
import resource
import subprocess
import sys
import textwrap

import httpx
import pytest

from proxy.api.runtime import GC_THRESHOLDS, SWITCH_INTERVAL_S, settle_runtime
from proxy.config.server import WANTED_DESCRIPTORS
from proxy.demo.runner import free_port
from tests.e2e.conftest import ROOT, wait_healthy

pytestmark = pytest.mark.e2e

# An app served by `serve` that answers with what its process's collector looks like.
SERVED = textwrap.dedent(
    """
    import gc, json, resource, sys
    from proxy.api.server import serve
    from proxy.config.server import ServerConfig

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20

    def burst():
        # Large blocks freed between smaller ones that stay, as a burst of big requests
        # leaves them: what the process holds at the peak and after.
        raised = [bytearray(4 * 2**20) for _ in range(2)]  # (raises glibc's threshold)
        del raised
        kept, blocks = [], []
        for _ in range(60):
            blocks.append(bytearray(3 * 2**20))
            kept.append(bytearray(1000))
        peak = rss_mb()
        del blocks
        return {"peak": peak, "after": rss_mb()}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = json.dumps({
            "frozen": gc.get_freeze_count(),
            "thresholds": gc.get_threshold(),
            "switch_interval": sys.getswitchinterval(),
            "descriptors": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            **(burst() if scope["path"] == "/burst" else {}),
        })
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body.encode()})

    serve(app, ServerConfig(host="127.0.0.1", port=int(sys.argv[1])))
    """
)


def _systemd_like_descriptors() -> None:
    """A soft RLIMIT_NOFILE of 1,024 under a higher hard one, as systemd gives services."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))


def test_the_served_process_settles_its_runtime() -> None:
    """Also: it raises its soft descriptor limit toward the hard one (under 1,024 it held 480
    client connections), and gives back large blocks a burst freed (glibc kept them: RSS stayed
    at its peak with few objects alive)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVED, str(port)], cwd=ROOT, preexec_fn=_systemd_like_descriptors
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        seen = httpx.get(f"http://127.0.0.1:{port}/").json()
        burst = httpx.get(f"http://127.0.0.1:{port}/burst", timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(10)
    assert seen["frozen"] > 10_000  # the modules and objects of start-up
    assert tuple(seen["thresholds"]) == GC_THRESHOLDS
    assert seen["switch_interval"] == SWITCH_INTERVAL_S
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert seen["descriptors"] == min(hard, WANTED_DESCRIPTORS)
    assert burst["peak"] > 150
    assert burst["after"] < burst["peak"] - 120  # given back: 180 MB of blocks


def test_settling_collects_freezes_and_shortens_the_switch_interval() -> None:
    before, interval = gc.get_threshold(), sys.getswitchinterval()
    try:
        settle_runtime()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == GC_THRESHOLDS
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
        sys.setswitchinterval(interval)
