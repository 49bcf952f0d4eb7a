"""A serving process keeps the heap of its start-up out of the garbage collector's scans, which
otherwise took a fifth of the CPU under load, and shortens the GIL's switch interval, which
otherwise let any busy thread hold the event loop up 5 ms at each of its wake-ups."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import httpx
import pytest

from proxy.api.runtime import GC_THRESHOLDS, SWITCH_INTERVAL_S, settle_runtime
from proxy.demo.runner import free_port
from tests.e2e.conftest import ROOT, wait_healthy

pytestmark = pytest.mark.e2e

# An app served by `serve` that answers with what its process's collector looks like.
SERVED = textwrap.dedent(
    """
    import gc, json, sys
    from proxy.api.server import serve
    from proxy.config.server import ServerConfig

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = json.dumps({
            "frozen": gc.get_freeze_count(),
            "thresholds": gc.get_threshold(),
            "switch_interval": sys.getswitchinterval(),
        })
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body.encode()})

    serve(app, ServerConfig(host="127.0.0.1", port=int(sys.argv[1])))
    """
)


def test_the_served_process_settles_its_runtime() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVED, str(port)], cwd=ROOT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        seen = httpx.get(f"http://127.0.0.1:{port}/").json()
    finally:
        proc.terminate()
        proc.wait(10)
    assert seen["frozen"] > 10_000  # the modules and objects of start-up
    assert tuple(seen["thresholds"]) == GC_THRESHOLDS
    assert seen["switch_interval"] == SWITCH_INTERVAL_S


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
