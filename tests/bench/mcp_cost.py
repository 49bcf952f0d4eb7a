"""The proxy's CPU per MCP tool call, over a python tool call, with no network noise: runs of
one tool call each through the app in-process (a scripted upstream behind the ASGI transport),
the MCP server a stdio child (its own CPU is not counted, only the proxy's).

    python -m tests.bench.mcp_cost [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from proxy.api.app import create_app
from proxy.config import parse_config
from tests.mcp_config import stdio_entry
from tests.scripted_upstream import ScriptedUpstream, call, each_run, keep, say_tool_result


def echo(text: str) -> str:
    """The python tool that matches the MCP server's `echo`."""
    return f"echo: {text}"


CONFIG: dict[str, Any] = {
    "upstreams": {"main": {"base_url": "http://upstream.test/v1", "max_retries": 0}},
    "default_upstream": "main",
    "pricing": {"scripted": {"input": 1.0, "output": 4.0}},
    "state": {"backend": "memory"},
    "tools": {
        "py_echo": {"kind": "python", "callable": "tests.bench.mcp_cost:echo"},
        "srv": stdio_entry(include=["echo"]),
    },
    "agents": {
        "python": {"model": "scripted", "tools": ["py_echo"]},
        "mcp": {"model": "scripted", "tools": ["srv"]},
    },
}


async def cpu_per_run(client: httpx.AsyncClient, agent: str, runs: int) -> float:
    """Seconds of this process's CPU per run of `agent` (after a few runs to warm up)."""
    body = {"model": agent, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(5):
        (await client.post("/v1/chat/completions", json=body)).raise_for_status()
    started = time.process_time()
    for _ in range(runs):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.json()["loop"]["tool_calls"] == 1, response.text
    return (time.process_time() - started) / runs


async def measure(runs: int) -> dict[str, float]:
    upstream = ScriptedUpstream()
    transport = httpx.ASGITransport(upstream.app)
    app = create_app(parse_config(CONFIG), transport=transport, registry=CollectorRegistry())
    results: dict[str, float] = {}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy") as client,
    ):
        for agent, tool in (("python", "py_echo"), ("mcp", "t_echo")):
            upstream.reset()
            upstream.script(keep(each_run(call(tool, text="bench"), say_tool_result())))
            results[agent] = await cpu_per_run(client, agent, runs)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mcp_cost")
    parser.add_argument("--runs", type=int, default=500)
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.runs))
    print("run of one tool call                CPU us")
    print(f"python tool                         {results['python'] * 1e6:.0f}")
    print(f"MCP tool (stdio)                    {results['mcp'] * 1e6:.0f}")
    print(f"added per MCP call                  {(results['mcp'] - results['python']) * 1e6:.0f}")


if __name__ == "__main__":
    main()
