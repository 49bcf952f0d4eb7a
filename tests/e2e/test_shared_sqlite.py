"""Two proxy processes on one sqlite file serialise the runs on a context between them: no
`/chat` of one overwrites the messages the other saved."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import yaml

from proxy.demo.runner import free_port
from tests.e2e.conftest import running
from tests.scripted_upstream import ScriptedUpstream, keep, say

RUNS = 20


def proxy_config(upstream_url: str, path: Path) -> dict[str, Any]:
    return {
        "upstreams": {"main": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "main",
        "state": {"backend": "sqlite", "path": str(path)},
    }


async def test_twenty_concurrent_chats_through_two_processes_keep_every_message(
    tmp_path: Path,
) -> None:
    upstream = ScriptedUpstream(keep(say("Noted.")))
    config = tmp_path / "loopwarden.yaml"
    ports = [free_port(), free_port()]
    with upstream.serve() as upstream_url:
        config.write_text(yaml.safe_dump(proxy_config(upstream_url, tmp_path / "shared.db")))
        args = [["-m", "proxy", "serve", "--config", str(config), "--port", str(p)] for p in ports]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        with (
            running(args[0], f"{urls[0]}/healthz"),
            running(args[1], f"{urls[1]}/healthz"),
        ):
            async with httpx.AsyncClient(timeout=60) as client:

                async def chat(url: str, **body: Any) -> httpx.Response:
                    return await client.post(f"{url}/chat", json={"context_id": "shared", **body})

                first = await chat(urls[0], model="scripted", message="note 0")
                assert first.status_code == 200, first.text
                replies = await asyncio.gather(
                    *(chat(urls[i % 2], message=f"note {i}") for i in range(1, RUNS + 1))
                )
                stored = (await client.get(f"{urls[1]}/v1/contexts/shared")).json()
    assert [r.status_code for r in replies] == [200] * RUNS, [r.text for r in replies]
    notes = sorted(m["content"] for m in stored["messages"] if m["role"] == "user")
    assert notes == sorted(f"note {i}" for i in range(RUNS + 1))
    assert len(stored["messages"]) == 2 * (RUNS + 1)  # each note and its answer
    upstream.check()
