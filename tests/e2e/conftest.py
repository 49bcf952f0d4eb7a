"""Real processes on 127.0.0.1: the scripted model and the proxy under uvicorn, a tool server."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.demo.runner import free_port, serve_in_thread
from proxy.demo.scenes import DEMO_CONFIG


@contextlib.contextmanager
def running(
    args: list[str], health_url: str, env: dict[str, str] | None = None, cwd: str | None = None
) -> Iterator[None]:
    """A process on 127.0.0.1, from when `health_url` answers until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, *args], env=None if env is None else {**os.environ, **env}, cwd=cwd
    )
    try:
        wait_healthy(health_url, proc)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=15)


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
def scripted_upstream() -> Iterator[str]:
    port = free_port()
    args = ["-m", "uvicorn", "proxy.demo.scripted_model:scripted_app", "--factory"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with running(args, f"http://127.0.0.1:{port}/v1/models"):
        yield f"http://127.0.0.1:{port}/v1"


class ToolServer:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def inventory(self, request: Request) -> JSONResponse:
        payload = json.loads(await request.body())
        self.calls.append(payload)
        item = payload["arguments"].get("item", "")
        return JSONResponse({"item": item, "in_stock": 7})


@pytest.fixture(scope="session")
def tool_server() -> Iterator[tuple[str, ToolServer]]:
    server = ToolServer()
    app = Starlette(routes=[Route("/inventory", server.inventory, methods=["POST"])])
    with serve_in_thread(app, free_port()) as url:
        yield url, server


@pytest.fixture(scope="session")
def proxy_url(
    scripted_upstream: str,
    tool_server: tuple[str, ToolServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    tools_url, _ = tool_server
    config = {
        "upstreams": {"scripted": {"base_url": scripted_upstream, "max_retries": 0}},
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
            **DEMO_CONFIG["tools"],
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
    path = folder / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    args = ["-m", "proxy", "serve", "--config", str(path), "--port", str(port)]
    with running(args, f"http://127.0.0.1:{port}/healthz"):
        yield f"http://127.0.0.1:{port}/v1"
