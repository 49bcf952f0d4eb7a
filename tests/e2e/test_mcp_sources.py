"""MCP tool sources end to end (SPEC §13): the proxy under uvicorn with two real MCP servers, one
over streamable HTTP on 127.0.0.1 (a process of its own, restarted by a test) and one over stdio
(the proxy's child, killed by a test), driven with the real `openai` SDK."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai import OpenAI

from tests.bodies import loop_of, tool_results
from tests.e2e.conftest import McpHttpServer, config_file, proxy_process, wait_ready
from tests.mcp_config import http_entry, stdio_entry
from tests.scripted_upstream import (
    ScriptedUpstream,
    call,
    calls,
    each_run,
    keep,
    say,
    say_tool_result,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mcp_server() -> Iterator[McpHttpServer]:
    server = McpHttpServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mcp_proxy(
    upstream_url: str, mcp_server: McpHttpServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    web = http_entry(mcp_server.url, prefix="w_", reconnect_max_s=1)
    config = {
        "upstreams": {"scripted": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "scripted",
        "pricing": {"scripted": {"input": 1.0, "output": 4.0}},
        "state": {"backend": "memory"},
        "tools": {"web": web, "local": stdio_entry(reconnect_max_s=1)},
        "agents": {
            "ruled": {
                "model": "scripted",
                "tools": ["web", "t_forecast", "t_die", "t_pid"],
                "tool_rules": [{"type": "run_first", "tool_name": "w_echo"}],
                "tool_call_limits": [{"tool_name": "w_echo", "run_limit": 1}],
            },
            "free": {"model": "scripted", "tools": ["web", "local"]},
        },
    }
    path = config_file(Path(tmp_path_factory.mktemp("mcp")), config)
    with proxy_process(path, health="/healthz") as base:
        wait_ready(base)
        yield base


@pytest.fixture
def client(mcp_proxy: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{mcp_proxy}/v1", api_key="x", max_retries=0, timeout=30) as c:
        yield c


def ask(client: OpenAI, model: str, text: str, stream: bool = False) -> tuple[str, dict[str, Any]]:
    """The answer and the loop report of one run, asked with the SDK (streaming or not)."""
    messages: Any = [{"role": "user", "content": text}]
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages)
        return reply.choices[0].message.content or "", loop_of(reply)
    content, loop = "", {}
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            if chunk.choices[0].finish_reason:
                loop = loop_of(chunk)
    return content, loop


@pytest.mark.parametrize("stream", [False, True])
def test_a_loop_calls_mcp_tools_under_a_rule_and_a_limit(
    client: OpenAI, upstream: ScriptedUpstream, stream: bool
) -> None:
    upstream.script(
        call("w_echo", text="first"),
        call("w_echo", text="again"),  # over the run limit: blocked, the run goes on
        call("t_forecast", city="Oslo"),
        say_tool_result("Forecast: {}"),
    )
    content, loop = ask(client, "ruled", "forecast", stream)
    assert content.endswith('Forecast: {"city":"Oslo","celsius":21.5}')
    assert (loop["stop_reason"], loop["tool_calls"]) == ("completed", 2)
    assert upstream.bodies[0]["tool_choice"]["function"]["name"] == "w_echo"  # run_first
    tool_messages = [m for m in upstream.bodies[3]["messages"] if m["role"] == "tool"]
    assert tool_messages[0]["content"] == "echo: first"
    assert "Tool call limit exceeded" in orjson.loads(tool_messages[1]["content"])["error"]


def test_the_stdio_server_killed_mid_run_is_a_tool_error_then_restarted(
    client: OpenAI, upstream: ScriptedUpstream, mcp_proxy: str
) -> None:
    upstream.script(call("w_echo", text="x"), call("t_pid"), call("t_die"), say("it died"))
    content, loop = ask(client, "ruled", "die")
    assert (content, loop["stop_reason"]) == ("it died", "completed")
    died = [m for m in upstream.bodies[3]["messages"] if m["role"] == "tool"][-1]
    assert "dropped the call" in orjson.loads(died["content"])["error"]
    old_pid = [m for m in upstream.bodies[2]["messages"] if m["role"] == "tool"][-1]["content"]
    wait_ready(mcp_proxy)
    upstream.script(call("w_echo", text="x"), call("t_pid"), say_tool_result())
    new_pid, _ = ask(client, "ruled", "pid")
    assert new_pid.isdigit()
    assert new_pid != old_pid


def test_the_http_server_restarted_is_reconnected(
    client: OpenAI, upstream: ScriptedUpstream, mcp_proxy: str, mcp_server: McpHttpServer
) -> None:
    upstream.script(keep(each_run(call("w_pid"), say_tool_result())))
    before, _ = ask(client, "free", "pid")
    assert before.isdigit()
    mcp_server.stop()
    down, loop = ask(client, "free", "pid while down")
    assert "error" in orjson.loads(down)  # a tool error, not an HTTP error
    assert loop["stop_reason"] == "completed"
    mcp_server.start()
    after = down
    for _ in range(100):  # reconnects wait at most reconnect_max_s (1 s) between attempts
        after, _ = ask(client, "free", "pid after restart")
        if after.isdigit():
            break
        time.sleep(0.2)
    assert after.isdigit()
    assert after != before  # the new server's session
    wait_ready(mcp_proxy)


def test_one_call_cut_short_fails_alone_and_calls_past_the_pool_wait_their_turn(
    upstream: ScriptedUpstream, upstream_url: str, tmp_path: Path
) -> None:
    """Over streamable HTTP: a balancer cutting one call's answer fails that call, not the
    three beside it nor the session; and more calls at once than the session's pool holds
    (100 connections) each get an answer."""
    server = McpHttpServer("cutting")
    server.start()
    config = {
        "upstreams": {"scripted": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "scripted",
        "state": {"backend": "memory"},
        # A call waiting for a connection past the pool's timeout (connect_timeout_s) fails.
        "tools": {"web": http_entry(server.url, prefix="w_", timeout_s=30, connect_timeout_s=1)},
        "agents": {"free": {"model": "scripted", "tools": ["web"]}},
    }
    naps = [call("w_nap", seconds=1) for _ in range(3)]
    many = [call("w_nap", seconds=1.5) for _ in range(110)]
    upstream.script(calls(*naps, call("w_cut")), say("one cut"), calls(*many), say("all in"))
    parallel: Any = {"loop": {"parallel_tool_calls": True}}
    try:
        with proxy_process(config_file(tmp_path, config), health="/healthz") as base:
            wait_ready(base)
            with OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60) as c:
                messages: Any = [{"role": "user", "content": "go"}]
                c.chat.completions.create(model="free", messages=messages, extra_body=parallel)
                cut = tool_results(upstream.bodies[1])
                ready = wait_ready(base, timeout_s=1)  # the session stayed up
                c.chat.completions.create(model="free", messages=messages, extra_body=parallel)
                answered = tool_results(upstream.bodies[3])
    finally:
        server.stop()
    assert cut[:3] == ["slept 1s"] * 3
    assert "SSE stream" in orjson.loads(cut[3])["error"]
    assert ready["status"] == "ready"
    assert answered == ["slept 1.5s"] * 110
