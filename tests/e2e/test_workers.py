"""`loopwarden serve --workers N`: N processes behind one port, one `/metrics` for all of them,
exact thread limits between them, a dead worker replaced, a clean stop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.workers import MAX_START_TRIES
from proxy.demo.runner import free_port
from tests.e2e.conftest import ROOT, McpHttpServer, wait_healthy
from tests.mcp_config import http_entry
from tests.scripted_upstream import ScriptedUpstream, call, each_run, keep, say
from tests.tools import TOOLS

RUNS = "loopwarden_runs_total"


def config(upstream_url: str, state: dict[str, Any]) -> dict[str, Any]:
    return {
        "upstreams": {"main": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "main",
        "tools": dict(TOOLS),
        "agents": {
            "capped": {
                "model": "scripted",
                "tools": ["get_weather"],
                "tool_call_limits": [{"tool_name": "get_weather", "thread_limit": 3}],
            }
        },
        "state": state,
    }


def config_file(folder: Path, state: dict[str, Any]) -> Path:
    """The config of an upstream that is never reached, with `state`, written in `folder`."""
    path = folder / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(config("http://127.0.0.1:9/v1", state)))
    return path


@contextmanager
def serving(
    path: Path,
    port: int,
    workers: int,
    *more: str,
    metrics_dir: Path | None = None,
    log: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if metrics_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    args = ["-m", "proxy", "serve", "--config", str(path), "--port", str(port), *more]
    with log.open("wb") if log else contextlib.nullcontext() as out:
        proc = subprocess.Popen(
            [sys.executable, *args, "--workers", str(workers)], env=env, stderr=out
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def workers_of(pid: int) -> set[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {int(child) for child in children}


def sample(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def scrape_until(client: httpx.AsyncClient, check: Any, timeout_s: float) -> str:
    """The first `/metrics` text that passes `check`, scraped every 0.1 s for `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check(scraped := (await client.get("/metrics")).text):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)
    return scraped


def until(check: Any, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


async def test_two_workers_share_one_port_one_metrics_and_exact_thread_limits(
    tmp_path: Path,
) -> None:
    upstream = ScriptedUpstream(keep(each_run(call("get_weather", city="Oslo"), say("4°C"))))
    port, probe_port = free_port(), free_port()
    path = tmp_path / "loopwarden.yaml"
    with upstream.serve() as upstream_url:
        state = {"backend": "sqlite", "path": str(tmp_path / "state.db")}
        path.write_text(yaml.safe_dump(config(upstream_url, state)))
        probes = ("--probe-port", str(probe_port))
        with serving(path, port, 2, *probes) as proc:
            until(lambda: len(workers_of(proc.pid)) == 2)
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                body = {"model": "capped", "messages": [{"role": "user", "content": "Oslo?"}]}
                plain = {**body, "model": "scripted"}
                upstream.script(keep(say("Hi.")))
                replies = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=plain) for _ in range(40))
                )
                assert {r.status_code for r in replies} == {200}
                upstream.script(keep(each_run(call("get_weather", city="Oslo"), say("4°C"))))
                threaded = {**body, "loop": {"thread_id": "t-1"}}
                capped = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=threaded) for _ in range(8))
                )
                assert {r.status_code for r in capped} == {200}
                # A worker applies its own updates before its scrape, the others' within 1 s;
                # the workers share the probe port too.
                client.base_url = httpx.URL(f"http://127.0.0.1:{probe_port}")
                scraped = await scrape_until(client, lambda s: sample(s, RUNS) == 48, 3.0)
    assert sample(scraped, RUNS) == 48  # every worker's runs, from any one
    assert sample(scraped, "loopwarden_tool_calls_total", outcome="ok") == 3  # exact across both
    assert sample(scraped, "loopwarden_build_info") == 1
    assert sample(scraped, "loopwarden_runs_in_flight") == 0
    assert proc.returncode == 0


def test_a_dead_worker_is_replaced_and_a_stop_ends_them_all(tmp_path: Path) -> None:
    port = free_port()
    path = config_file(tmp_path, {"backend": "sqlite", "path": str(tmp_path / "state.db")})
    with serving(path, port, workers=2) as proc:
        until(lambda: len(workers_of(proc.pid)) == 2)
        first = workers_of(proc.pid)
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        until(lambda: len(workers_of(proc.pid)) == 2 and victim not in workers_of(proc.pid))
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        survivors = workers_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    for pid in survivors:
        until(lambda pid=pid: not Path(f"/proc/{pid}").exists() or _zombie(pid))


def test_a_worker_that_replaces_another_does_not_make_a_deleted_state_file_anew(
    tmp_path: Path,
) -> None:
    """The file deleted under the server, a worker that dies is replaced by one that finds it
    gone as the others do (`/readyz` 503), not by one serving a fresh file of its own (empty
    contexts, thread counts at 0) beside them."""
    port, db = free_port(), tmp_path / "state.db"
    path = tmp_path / "loopwarden.yaml"
    path.write_text(
        yaml.safe_dump(config("http://127.0.0.1:9/v1", {"backend": "sqlite", "path": str(db)}))
    )
    with serving(path, port, workers=2) as proc:
        until(lambda: len(workers_of(proc.pid)) == 2)
        for part in tmp_path.glob("state.db*"):
            part.unlink()
        victim = min(workers_of(proc.pid))
        os.kill(victim, signal.SIGKILL)
        until(lambda: len(workers_of(proc.pid)) == 2 and victim not in workers_of(proc.pid))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            answers = {
                client.get("/readyz", headers={"connection": "close"}).status_code
                for _ in range(40)
            }
    assert answers == {503}
    assert not db.exists()


def test_workers_stop_when_their_supervisor_is_killed_outright(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer) leaves no worker serving the port: a new `serve` binds it."""
    port = free_port()
    path = config_file(tmp_path, {"backend": "sqlite", "path": str(tmp_path / "state.db")})
    with serving(path, port, workers=2) as proc:
        until(lambda: len(workers_of(proc.pid)) == 2)
        orphans = workers_of(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        try:
            for pid in orphans:
                until(lambda pid=pid: not Path(f"/proc/{pid}").exists() or _zombie(pid))
        finally:  # none left behind when it fails
            for pid in orphans:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    with serving(path, port, workers=1):
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200


def test_one_process_in_multiprocess_mode_starts_without_what_a_killed_one_left(
    tmp_path: Path,
) -> None:
    """With `PROMETHEUS_MULTIPROC_DIR` set and one worker, a crash's counts and live gauges are
    not read back: the directory is emptied at start, as with several workers."""
    port, folder = free_port(), tmp_path / "metrics"
    path = tmp_path / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(config("http://127.0.0.1:9/v1", {"backend": "memory"})))
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    with serving(path, port, workers=1, metrics_dir=folder) as proc:
        url = f"http://127.0.0.1:{port}"
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code == 502
        assert sample(httpx.get(f"{url}/metrics").text, RUNS) == 1
        proc.kill()
        proc.wait(timeout=10)
    assert list(folder.glob("*.db"))  # what it left
    with serving(path, port, workers=1, metrics_dir=folder):
        assert sample(httpx.get(f"http://127.0.0.1:{port}/metrics").text, RUNS) == 0


def _zombie(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return "\nState:\tZ" in status


def test_workers_refuse_the_per_process_memory_backend(tmp_path: Path) -> None:
    path = tmp_path / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(config("http://127.0.0.1:9/v1", {"backend": "memory"})))
    args = ["-m", "proxy", "serve", "--config", str(path), "--workers", "2"]
    done = subprocess.run(
        [sys.executable, *args], env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "state: " in done.stderr
    assert "the memory backend is per process" in done.stderr


def test_workers_that_cannot_start_stop_the_server(tmp_path: Path) -> None:
    """A required MCP source that cannot connect fails every worker the same way: the server
    exits 1 instead of starting workers for ever."""
    path = tmp_path / "loopwarden.yaml"
    state = {"backend": "sqlite", "path": str(tmp_path / "state.db")}
    document = config("http://127.0.0.1:9/v1", state)
    document["tools"]["down"] = {
        "kind": "mcp",
        "url": "http://127.0.0.1:9/mcp",
        "required": True,
        "connect_timeout_s": 1,
    }
    path.write_text(yaml.safe_dump(document))
    args = ["-m", "proxy", "serve", "--config", str(path), "--workers", "2"]
    args += ["--port", str(free_port())]
    done = subprocess.run(
        [sys.executable, *args], env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "could not start" in done.stderr


def test_a_worker_that_replaces_another_and_cannot_start_is_tried_again(
    tmp_path: Path,
) -> None:
    """A required MCP source was up as the server started and down as a dead worker was
    replaced: the replacement could not start, and the supervisor stopped the worker still
    serving and exited. It tries the replacement again, later each time, and the server
    serves meanwhile."""
    mcp = McpHttpServer()
    mcp.start()
    path = tmp_path / "loopwarden.yaml"
    document = config("http://127.0.0.1:9/v1", {"backend": "sqlite", "path": str(tmp_path / "s")})
    document["tools"]["web"] = http_entry(mcp.url, required=True, connect_timeout_s=1)
    path.write_text(yaml.safe_dump(document))
    port = free_port()
    log = tmp_path / "serve.log"
    try:
        with serving(path, port, workers=2, log=log) as proc:
            # Both workers started (one still starting as the source goes fails at the start).
            until(lambda: log.read_text().count(") connected: ") == 2)
            mcp.stop()
            victim = min(workers_of(proc.pid))
            os.kill(victim, signal.SIGKILL)
            time.sleep(4)  # the replacement fails (1 s), and is tried again in 2 s (1 s more)
            assert proc.poll() is None
            assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
            mcp.start()
            until(lambda: _settled(proc.pid), timeout_s=40)  # tried again in 4 s at most
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
    finally:
        mcp.stop()


def _settled(supervisor: int) -> bool:
    """Two workers, the same for 3 s: a replacement that cannot start exits within 1 s."""
    before = workers_of(supervisor)
    time.sleep(3)
    return len(before) == 2 and workers_of(supervisor) == before


def test_serve_says_the_address_it_serves_on(tmp_path: Path) -> None:
    """`--port 0` takes a port the system picks: the log names it."""
    path = tmp_path / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(config("http://127.0.0.1:9/v1", {"backend": "memory"})))
    args = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True) as process:
        try:
            assert process.stderr is not None
            line = process.stderr.readline()
            assert " serving on 127.0.0.1:" in line, line
            port = int(line.rsplit(":", 1)[1])
            assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_a_stopping_server_takes_no_connection_while_its_workers_drain(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str
) -> None:
    """The supervisor kept the port's socket open: the kernel took new connections for no
    one, each left hanging until the drain ended."""
    state = {"backend": "sqlite", "path": str(tmp_path / "state.db")}
    settings = {**config(upstream_url, state), "server": {"shutdown_timeout_s": 10}}
    path = tmp_path / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(settings))
    upstream.script(say("late").replace(after_s=4))
    port = free_port()
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    with serving(path, port, workers=2) as proc, httpx.Client(timeout=30) as client:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            asking = pool.submit(
                client.post, f"http://127.0.0.1:{port}/v1/chat/completions", json=body
            )
            until(lambda: len(upstream.bodies) == 1)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # refused at once, not left hanging
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
            answered = asking.result(timeout=30)
        assert proc.wait(timeout=30) == 0
    assert answered.status_code == 200  # the run in flight drained


SUPERVISED = """
import sys
from pathlib import Path
from proxy.api.workers import listen, supervise

tries = Path(sys.argv[1])


def work(sock):
    tries.write_text(tries.read_text() + "x")  # (one worker: one writer at a time)
    return len(tries.read_text()) == 1  # the first starts and ends; the rest cannot start


sys.exit(supervise(1, listen("127.0.0.1", 0), work, waits=lambda _: 0.01))
"""


def test_a_worker_whose_replacements_cannot_start_stops_the_server_after_its_tries(
    tmp_path: Path,
) -> None:
    """A replacement that cannot start is tried again, less and less often (2 to 30 s, the
    other workers serving); after MAX_START_TRIES in a row (90 s) the server stops, the
    orchestrator told by its exit status."""
    tries = tmp_path / "tries"
    tries.write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # (the supervisor empties the one it is given)
    done = subprocess.run(
        [sys.executable, "-c", SUPERVISED, str(tries)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    # The first served; its replacement, then MAX_START_TRIES more, could not start.
    assert len(tries.read_text()) == 1 + 1 + MAX_START_TRIES
    assert done.stderr.count("could not start again; another tries in 0.01 s") == MAX_START_TRIES
    assert f"worker 0 could not start ({MAX_START_TRIES + 1} in a row); stopping" in done.stderr
