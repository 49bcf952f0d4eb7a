"""What `loopwarden serve` writes to its log when an answer is cut after it began: the cause,
once, and not the ASGI server's error that the app left a response unfinished (which it does
only on purpose: the connection is closed and the client sees the answer cut)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from proxy.api.server import UNFINISHED_ON_PURPOSE
from proxy.demo.runner import free_port
from proxy.telemetry.http import CUT_ON_PURPOSE
from tests.e2e.conftest import ROOT, McpHttpServer, wait_healthy, wait_ready
from tests.faulty_upstream import FaultyUpstream, drip, stream
from tests.mcp_config import http_entry
from tests.scripted_upstream import ScriptedUpstream, call, say_tool_result

UNFINISHED = "ASGI callable returned without completing response."
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
CUTS = {
    "trickles past the step timeout": (
        drip(b'{"data": []}', every_s=0.05),
        "upstream main did not finish within 0.5 s: cut",
    ),
    "reset after its first bytes": (
        stream(b'{"data": [', then="reset"),
        "upstream main: the relayed answer was cut: upstream main failed mid-answer",
    ),
}


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, config: dict[str, Any], name: str = "loopwarden", log: Path | None = None
) -> AsyncIterator[int]:
    """`loopwarden serve` with `config` on a free port (given), its log to `log`, stopped after."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    args = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--port", str(port)]
    with (log or Path("/dev/null")).open("wb") as out:
        proc = await asyncio.to_thread(subprocess.Popen, args, env=ENV, stderr=out)
    try:
        await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{port}/healthz", proc)
        yield port
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 15)


def failed_start(tmp_path: Path, config: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """`loopwarden serve` with `config`, run to its end (one that does not start)."""
    path = tmp_path / "failing.yaml"
    path.write_text(yaml.safe_dump(config))
    args = [sys.executable, "-m", "proxy", "serve", "--config", str(path), "--port", "0"]
    return subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("cut", CUTS)
async def test_a_relayed_answer_cut_after_it_began_is_logged_once_with_its_cause(
    tmp_path: Path, cut: str
) -> None:
    answer, cause = CUTS[cut]
    async with FaultyUpstream() as upstream:
        upstream.script(answer)
        config = {
            "upstreams": {"main": {"base_url": upstream.url, "step_timeout_s": 0.5}},
            "default_upstream": "main",
            "state": {"backend": "memory"},
        }
        log = tmp_path / "serve.log"
        async with serving(tmp_path, config, log=log) as port:
            body = {"model": "e", "input": "x"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                with pytest.raises(httpx.RemoteProtocolError):  # the answer ends cut short
                    await client.post("/v1/embeddings", json=body, timeout=10)
    text = log.read_text()
    assert text.count(cause) == 1, text
    assert "ASGI callable" not in text, text


def test_a_start_up_that_fails_says_why_once_and_exits_1(tmp_path: Path) -> None:
    """A required MCP server that does not connect: its reason, no traceback, no claim to be
    serving, and the exit status README gives (uvicorn's own was 3)."""
    never = [sys.executable, "-c", "pass"]  # a server that exits at once
    config = {
        "upstreams": {"main": {"base_url": "http://127.0.0.1:9/v1"}},
        "default_upstream": "main",
        "tools": {"gone": {"kind": "mcp", "command": never, "required": True}},
    }
    done = failed_start(tmp_path, config)
    assert done.returncode == 1, done.stderr
    assert "tools.gone: required MCP server 'gone' (python" in done.stderr
    assert "Traceback" not in done.stderr
    assert "serving on" not in done.stderr


def test_only_an_answer_left_unfinished_on_purpose_goes_untold() -> None:
    """uvicorn's error for an unfinished answer is dropped only where the app cut it and said
    why: one a route left unfinished by mistake is still told."""
    record = logging.LogRecord("uvicorn.error", logging.ERROR, "", 0, UNFINISHED, None, None)
    assert UNFINISHED_ON_PURPOSE.filter(record)  # nothing said why
    token = CUT_ON_PURPOSE.set(True)
    try:
        assert not UNFINISHED_ON_PURPOSE.filter(record)
    finally:
        CUT_ON_PURPOSE.reset(token)


async def test_requests_that_cannot_be_read_are_told_once_a_second(tmp_path: Path) -> None:
    """uvicorn told each one, with its traceback: 6,000 bad requests made 1,200 lines."""
    config = {
        "upstreams": {"main": {"base_url": "http://127.0.0.1:9/v1"}},
        "default_upstream": "main",
        "state": {"backend": "memory"},
    }
    log = tmp_path / "serve.log"
    async with serving(tmp_path, config, log=log) as port:
        started = time.monotonic()
        for _ in range(40):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"G\x00T / HTTP/1.1\r\n\r\n")
            assert (await reader.read(1024)).startswith(b"HTTP/1.1 400")
            writer.close()
        took = time.monotonic() - started
        await asyncio.sleep(1.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"G\x00T / HTTP/1.1\r\n\r\n")
        await reader.read(1024)
        writer.close()
    text = log.read_text()
    told = [line for line in text.splitlines() if "Invalid HTTP request received." in line]
    untold = [int(n) for n in re.findall(r"\((\d+) more since the last told\)", text)]
    assert len(told) + sum(untold) == 41, text  # every one counted, in a line or in a count
    assert 2 <= len(told) <= took + 2  # one a second at most, and the last, after a pause


async def test_a_sqlite_file_another_process_keeps_in_the_other_journal_says_so_and_exits_1(
    tmp_path: Path,
) -> None:
    """A second proxy on one file with another `sqlite_journal` exited with a traceback whose
    last line said only `database is locked`."""
    path = tmp_path / "state.db"

    def config(journal: str) -> dict[str, Any]:
        return {
            "upstreams": {"main": {"base_url": "http://127.0.0.1:9/v1"}},
            "default_upstream": "main",
            "state": {
                "backend": "sqlite",
                "path": str(path),
                "sqlite_journal": journal,
                "timeout_s": 0.5,
            },
        }

    async with serving(tmp_path, config("wal"), "wal"):
        second = await asyncio.to_thread(failed_start, tmp_path, config("rollback"))
    assert second.returncode == 1, second.stderr
    assert "cannot use the rollback journal" in second.stderr
    assert "state.sqlite_journal differs: it must be the same" in second.stderr
    assert "Traceback" not in second.stderr


async def test_an_mcp_server_s_url_and_refused_answers_are_told_without_token_or_traceback(
    tmp_path: Path, upstream: ScriptedUpstream, upstream_url: str
) -> None:
    """httpx2 told every MCP exchange at INFO with the server's URL, token and all, and the
    SDK an answer over `max_message_bytes` with a 30-line traceback at ERROR, each time."""
    server = McpHttpServer(legacy=False)
    server.start()
    try:
        mcp = http_entry(f"{server.url}?token=s3cr3t", prefix="w_", max_message_bytes=65536)
        config = {
            "upstreams": {"main": {"base_url": upstream_url, "max_retries": 0}},
            "default_upstream": "main",
            "state": {"backend": "memory"},
            "tools": {"web": mcp},
            "agents": {"bot": {"model": "m", "tools": ["web"]}},
        }
        log = tmp_path / "serve.log"
        async with serving(tmp_path, config, log=log) as port:
            base = f"http://127.0.0.1:{port}"
            await asyncio.to_thread(wait_ready, base)
            async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x") as client:
                for _ in range(3):
                    upstream.script(call("w_large", kib=100), say_tool_result())
                    reply = await client.chat.completions.create(
                        model="bot", messages=[{"role": "user", "content": "big"}]
                    )
                    assert "max_message_bytes" in (reply.choices[0].message.content or "")
    finally:
        server.stop()
    text = log.read_text()
    assert "s3cr3t" not in text, text
    assert "Traceback" not in text, text
    told = [line for line in text.splitlines() if "answer was refused" in line]
    assert len(told) in (1, 2), text  # once a second
    assert "max_message_bytes" in told[0]
