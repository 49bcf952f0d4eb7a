"""The benchmark's servers as processes on 127.0.0.1, on free ports, pinned to a core, stopped
(with their children) when the block ends, on an error or on Ctrl-C; and what /proc says of
their CPU time and memory."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from proxy.demo.runner import free_port

ROOT = Path(__file__).parents[2]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
UVICORN = ["--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"]


def cores() -> int:
    return os.cpu_count() or 1


def pinned(cpus: str) -> list[str]:
    """`taskset -c cpus`, when there are two cores or more to pin to and taskset is there."""
    return ["taskset", "-c", cpus] if cpus and cores() >= 2 and shutil.which("taskset") else []


@dataclass
class Servers:
    """Starts processes and stops them all when its `running()` block ends."""

    folder: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # every one started, for CPU accounting

    def start(self, argv: list[str], health: str, cpus: str = "", **env: str) -> int:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [*pinned(cpus), *argv],
            env={**os.environ, "PYTHONPATH": path, **env},
            cwd=self.folder,
            stdout=2,  # to this process's stderr: the table alone goes to stdout
            start_new_session=True,  # its own process group: stopped with its workers
        )
        self.started.append(proc)
        self.pids.append(proc.pid)
        deadline = time.monotonic() + 60
        while not _answers(health):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(argv)} did not come up at {health}")
            time.sleep(0.05)
        return proc.pid

    def stop(self) -> None:
        """The last started first: a proxy flushes to a receiver before the receiver goes."""
        while self.started:
            proc = self.started.pop()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def mock(self, cpus: str = "0", *options: str) -> tuple[str, int]:
        port = free_port()
        argv = [sys.executable, "-m", "tests.bench.mock_upstream", "--port", str(port), *options]
        pid = self.start(argv, f"http://127.0.0.1:{port}/health", cpus)
        return f"http://127.0.0.1:{port}/v1", pid

    def floor(
        self, upstream: str, server: str = "uvicorn", cpus: str = "1", client: str = "aiohttp"
    ) -> tuple[str, int]:
        port = free_port()
        if server == "granian":
            argv = ["-m", "granian", "--interface", "asgi", "--loop", "uvloop", "--no-ws"]
            argv += ["--host", "127.0.0.1"]
            argv += ["--log-level", "warning", "--port", str(port), "tests.bench.floor:app"]
        else:
            argv = ["-m", "uvicorn", "tests.bench.floor:app", "--port", str(port), *UVICORN]
        health, up = f"http://127.0.0.1:{port}/v1/models", upstream.removesuffix("/v1")
        pid = self.start([sys.executable, *argv], health, cpus, UPSTREAM=up, FLOOR_CLIENT=client)
        return f"http://127.0.0.1:{port}/v1", pid

    def loopwarden(
        self,
        upstream: str,
        workers: int = 1,
        cpus: str = "1",
        server: Any = None,
        sqlite: bool = False,
        **env: str,
    ) -> tuple[str, int]:
        """Loopwarden on `workers` processes; its state in sqlite when `sqlite` or several
        workers (which cannot share memory), else in memory."""
        port = free_port()
        state = self.folder / f"state-{port}"
        config = loopwarden_config(upstream, state, workers > 1 or sqlite, server or {})
        path = self.folder / f"loopwarden-{port}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--port", str(port)]
        argv += ["--workers", str(workers)]
        pid = self.start(argv, f"http://127.0.0.1:{port}/healthz", cpus, **env)
        return f"http://127.0.0.1:{port}/v1", pid

    def litellm(self, binary: str, upstream: str, key: str, cpus: str = "1") -> tuple[str, int]:
        port = free_port()
        path = self.folder / "litellm.yaml"
        params = {"api_base": upstream, "api_key": "sk-mock"}
        models = [
            {"model_name": "mock", "litellm_params": {"model": "openai/mock", **params}},
            {"model_name": "mock-ttft", "litellm_params": {"model": "openai/mock+cd2", **params}},
        ]
        config = {
            "model_list": models,
            "litellm_settings": {"telemetry": False, "callbacks": [], "num_retries": 0},
            "general_settings": {"master_key": key},
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [binary, "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
        health = f"http://127.0.0.1:{port}/health/liveliness"
        pid = self.start([*argv, "--num_workers", "1"], health, cpus, **env)
        return f"http://127.0.0.1:{port}/v1", pid


@contextlib.contextmanager
def running(folder: Path) -> Iterator[Servers]:
    """Servers stopped when the block ends; a SIGTERM to this process ends it too."""
    servers = Servers(folder)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield servers
    finally:
        servers.stop()
        signal.signal(signal.SIGTERM, previous)


def loopwarden_config(
    upstream: str, state: Path, sqlite: bool, server: dict[str, Any]
) -> dict[str, Any]:
    """One upstream (the mock, no retries), prices, a python server tool, sync and async, and
    an agent that calls each; state in memory, or in sqlite under `state`."""
    backend: dict[str, Any] = {"backend": "memory"}
    if sqlite:
        state.mkdir(parents=True, exist_ok=True)
        backend = {"backend": "sqlite", "path": str(state / "loopwarden.db")}
    return {
        "server": server,
        "upstreams": {"mock": {"base_url": upstream, "max_retries": 0}},
        "default_upstream": "mock",
        "pricing": {"mock": {"input": 0.15, "output": 0.6}},
        "state": backend,
        "tools": {
            "get_weather": {"kind": "python", "callable": "proxy.demo.tools:get_weather"},
            "get_weather_async": {"kind": "python", "callable": "tests.bench.tools:get_weather"},
        },
        "agents": {
            "bench-agent": {"model": "mock", "tools": ["get_weather"]},
            "bench-agent-async": {"model": "mock", "tools": ["get_weather_async"]},
        },
    }


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status < 500)
    except (urllib.error.URLError, OSError):
        return False


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from /proc."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` and its descendants."""
    ticks = 0
    for each in tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{each}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def busy_seconds() -> float:
    """CPU time the processes of the whole machine ran (user, nice, system) and the time other
    guests of the host took (steal), every core, from /proc/stat; interrupts aside, since the
    kernel charges them to no process."""
    with open("/proc/stat") as f:
        user, nice, system, _, _, _, _, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + steal) / CLOCK_TICKS


def own_seconds(pids: list[int]) -> float:
    """CPU time of this process, its finished children (wrk) and the servers `pids`."""
    me, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    spent = me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
    return spent + sum(cpu_seconds(pid) for pid in pids)


def rss_bytes(pid: int) -> int:
    """Resident memory (VmRSS) of `pid` and its descendants."""
    total = 0
    for each in tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{each}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total
