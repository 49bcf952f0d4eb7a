"""Real servers on 127.0.0.1: the proxy as a process, a scripted upstream and a tool server in
threads of the test process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.demo.runner import free_port, serve_in_thread
from tests.mcp_config import http_server_args
from tests.scripted_upstream import ScriptedUpstream
from tests.tools import TOOLS

ROOT = Path(__file__).parents[2]


@contextlib.contextmanager
def running(
    args: list[str], health_url: str, env: dict[str, str] | None = None, cwd: str | None = None
) -> Iterator[None]:
    """A process on 127.0.0.1, from when `health_url` answers until the block ends. It can
    import the tests' python tools (`tests.tools`) from any working directory."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    proc = subprocess.Popen(
        [sys.executable, *args], env={**os.environ, **(env or {}), "PYTHONPATH": path}, cwd=cwd
    )
    try:
        wait_healthy(health_url, proc)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def config_file(folder: Path, config: dict[str, Any]) -> Path:
    """`config` written as the proxy's YAML config in `folder`."""
    path = folder / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@contextlib.contextmanager
def proxy_process(
    config: Path, env: dict[str, str] | None = None, health: str = "/readyz"
) -> Iterator[str]:
    """`loopwarden serve` of `config` on a free port; its base URL once `health` answers."""
    port = free_port()
    args = ["-m", "proxy", "serve", "--config", str(config), "--port", str(port)]
    with running(args, f"http://127.0.0.1:{port}{health}", env):
        yield f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


@pytest.fixture(scope="session")
def served_upstream() -> Iterator[ScriptedUpstream]:
    """One scripted upstream on 127.0.0.1 for the session; tests script it through `upstream`."""
    scripted = ScriptedUpstream()
    with scripted.serve():
        yield scripted


@pytest.fixture(scope="session")
def upstream_url(served_upstream: ScriptedUpstream) -> str:
    """The base URL (with /v1) of the scripted upstream, for the proxies' configs."""
    assert served_upstream.url is not None
    return served_upstream.url


@pytest.fixture(autouse=True)
def upstream(served_upstream: ScriptedUpstream) -> Iterator[ScriptedUpstream]:
    """The scripted upstream with no script and no records, for every test: a request beyond the
    script the test sets fails it at teardown."""
    served_upstream.reset()
    yield served_upstream
    served_upstream.check()


class ToolServer:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def inventory(self, request: Request) -> JSONResponse:
        payload = json.loads(await request.body())
        self.calls.append(payload)
        item = payload["arguments"].get("item", "")
        return JSONResponse({"item": item, "in_stock": 7})


@contextlib.contextmanager
def serving_post(path: str, endpoint: Callable[[Request], Awaitable[Response]]) -> Iterator[str]:
    """`POST path` answered by `endpoint`, on a free port of 127.0.0.1 in a thread."""
    app = Starlette(routes=[Route(path, endpoint, methods=["POST"])])
    with serve_in_thread(app, free_port()) as url:
        yield url


@pytest.fixture(scope="session")
def tool_server() -> Iterator[tuple[str, ToolServer]]:
    server = ToolServer()
    with serving_post("/inventory", server.inventory) as url:
        yield url, server


@pytest.fixture(scope="session")
def proxy_url(
    upstream_url: str,
    tool_server: tuple[str, ToolServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    tools_url, _ = tool_server
    config = {
        "upstreams": {"scripted": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "scripted",
        "pricing": {"scripted": {"input": 1.0, "output": 4.0}},
        "tools": {
            "check_inventory": {
                "kind": "http",
                "url": f"{tools_url}/inventory",
                "description": "How many of an item are in stock.",
                "parameters": {
                    "type": "object",
                    "properties": {"item": {"type": "string"}},
                    "required": ["item"],
                },
            },
            **TOOLS,
        },
        "agents": {
            "stock": {
                "model": "scripted",
                "tools": ["check_inventory"],
                "system_prompt": "You track stock.",
            },
            "reporter": {"model": "scripted", "tools": ["get_weather", "final_answer"]},
            "researcher": {
                "model": "scripted",
                "tools": ["search_notes"],
                "stop_when": [{"max_tokens_used": 1500}],
            },
        },
    }
    folder = Path(tmp_path_factory.mktemp("e2e"))
    config["state"] = {"backend": "sqlite", "path": str(folder / "loopwarden.db")}
    with proxy_process(config_file(folder, config), health="/healthz") as base:
        yield f"{base}/v1"


class McpHttpServer:
    """The tests' MCP server on 127.0.0.1:port/mcp, in the handshake era (session ids), as a
    process that a test may stop and start again on the same port."""

    def __init__(self, *options: str, legacy: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.options = options  # more of tests/mcp_server.py's
        self.legacy = legacy  # else of the 2026 era: no session, JSON answers
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = http_server_args(self.port, self.legacy, *self.options)
        self.proc = subprocess.Popen([sys.executable, *args])
        wait_healthy(self.url, self.proc)  # any HTTP answer (a 4xx without a session) will do

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
            self.proc = None


def wait_ready(base: str, timeout_s: float = 30) -> dict[str, object]:
    """/readyz once every MCP source is connected."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{base}/readyz", timeout=5).json()
        if body["status"] == "ready" and "mcp_missing" not in body:
            return dict(body)
        if time.monotonic() > deadline:
            raise AssertionError(f"not ready: {body}")
        time.sleep(0.1)
