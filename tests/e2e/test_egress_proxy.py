"""`loopwarden serve` behind a company's egress proxy: the upstreams are reached through the
web proxy its environment names, the real `openai` SDK as the client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from tests.e2e.conftest import config_file, proxy_process
from tests.scripted_upstream import ScriptedUpstream, say
from tests.web_proxy import UPSTREAM_HOST, forward_proxy

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
