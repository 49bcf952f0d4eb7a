"""`loopwarden serve` behind a company's egress proxy: the upstreams and the tool servers are
reached through the web proxy its environment names, the real `openai` SDK as the client."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.conftest import McpHttpServer, ToolServer, config_file, proxy_process, wait_ready
from tests.mcp_config import http_entry
from tests.scripted_upstream import ScriptedUpstream, call, calls, say
from tests.web_proxy import UPSTREAM_HOST, forward_proxy, forward_proxy_thread

pytestmark = pytest.mark.e2e


async def test_upstream_calls_go_through_the_environment_s_web_proxy(
    upstream: ScriptedUpstream, upstream_url: str, tmp_path: Path
) -> None:
    upstream.script(say("Through the proxy."), say("Again."))
    outside = upstream_url.replace("127.0.0.1", UPSTREAM_HOST)  # a name only the proxy knows
    config = {
        "upstreams": {"main": {"base_url": outside, "max_retries": 0}},
        "default_upstream": "main",
        "state": {"backend": "memory"},
    }
    async with forward_proxy() as web:
        env = {"HTTP_PROXY": web.url, "NO_PROXY": "", "no_proxy": ""}
        with proxy_process(config_file(tmp_path, config), env, health="/healthz") as base:
            async with AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
                messages: Any = [{"role": "user", "content": "Hi."}]
                reply = await client.chat.completions.create(model="m", messages=messages)
                stream = await client.chat.completions.create(
                    model="m", messages=messages, stream=True
                )
                text = "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
    assert reply.choices[0].message.content == "Through the proxy."
    assert text == "Again."
    assert web.lines == [f"POST {outside}/chat/completions HTTP/1.1"]  # one kept connection


def test_tool_servers_are_reached_through_the_environment_s_web_proxy(
    upstream: ScriptedUpstream,
    upstream_url: str,
    tool_server: tuple[str, ToolServer],
    tmp_path: Path,
) -> None:
    """An http tool and an MCP server over HTTP, each at a name only the egress proxy resolves;
    the upstream (on loopback) is reached directly."""
    upstream.script(
        calls(call("check_inventory", item="bolts"), call("w_echo", text="hi")), say("Done.")
    )
    mcp = McpHttpServer("outside")
    mcp.start()
    tools_url = tool_server[0].replace("127.0.0.1", UPSTREAM_HOST)
    mcp_url = mcp.url.replace("127.0.0.1", UPSTREAM_HOST)
    config = {
        "upstreams": {"main": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "main",
        "state": {"backend": "memory"},
        "tools": {
            "check_inventory": {"kind": "http", "url": f"{tools_url}/inventory"},
            "web": http_entry(mcp_url, prefix="w_"),
        },
        "agents": {"clerk": {"model": "m", "tools": ["check_inventory", "web"]}},
    }
    try:
        with forward_proxy_thread() as web:
            keyed = web.url.replace("http://", "http://clerk:s%40fe@")  # user and password
            env = {"HTTP_PROXY": keyed, "NO_PROXY": "", "no_proxy": ""}
            with proxy_process(config_file(tmp_path, config), env, health="/healthz") as base:
                wait_ready(base)
                with OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
                    messages: Any = [{"role": "user", "content": "Bolts?"}]
                    reply = client.chat.completions.create(model="clerk", messages=messages)
    finally:
        mcp.stop()
    assert reply.choices[0].message.content == "Done."
    results = [m["content"] for m in upstream.bodies[1]["messages"] if m["role"] == "tool"]
    assert '"in_stock":7' in results[0].replace(" ", "")
    assert results[1] == "echo: hi"
    assert f"POST {tools_url}/inventory HTTP/1.1" in web.lines
    assert f"POST {mcp_url} HTTP/1.1" in web.lines
    assert not any("127.0.0.1" in line for line in web.lines)  # the upstream: direct
    assert set(web.authorizations) == {"Basic " + base64.b64encode(b"clerk:s@fe").decode()}
