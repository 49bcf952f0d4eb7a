"""Codex CLI (`codex exec`) with a custom model provider (`wire_api = "responses"`, `base_url` at
the proxy) answering prompts through an agent with server tools. Codex streams, sends
`store: false` with its whole history each time, `developer` messages, `namespace` and hosted
tool types, and ignores the `mcp_call` items of the server calls.

The agent is `stock`: Codex's own prompt and tools are about 10k tokens, past the researcher's
1500-token stop condition."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import ToolServer
from tests.e2e.node import RUN_TIMEOUT_S, installed
from tests.scripted_upstream import ScriptedUpstream, call, say_tool_result

pytestmark = pytest.mark.e2e

STOCK = '{"item":"washers","in_stock":7}'  # what the tool server answers check_inventory

CONFIG = """\
model = "stock"
model_provider = "lw"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.lw]
name = "lw"
base_url = "{base_url}"
wire_api = "responses"
env_key = "LW_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false
"""


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed(tmp_path_factory.getbasetemp())


@pytest.fixture
def inventory(tool_server: tuple[str, ToolServer]) -> ToolServer:
    """The tool server behind `check_inventory`, with no calls recorded."""
    _, server = tool_server
    server.calls.clear()
    return server


def codex_exec(clients: Path, proxy_url: str, home: Path, prompt: str) -> list[dict[str, Any]]:
    """Runs `codex exec --json` in a fresh CODEX_HOME pointed at the proxy; returns its events.
    No login, no update check, no session files, a read-only sandbox, no approvals."""
    codex_home = home / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(CONFIG.format(base_url=proxy_url))
    work = home / "work"
    work.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CODEX_HOME": str(codex_home),
        "LW_KEY": "sk-e2e",
    }
    codex = clients / "node_modules" / ".bin" / "codex"
    args = [
        str(codex),
        "exec",
        "--strict-config",
        "--skip-git-repo-check",
        "--ephemeral",
        "--json",
        prompt,
    ]
    finished = subprocess.run(
        args,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert finished.returncode == 0, f"codex exec failed:\n{finished.stdout}\n{finished.stderr}"
    return [json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")]


def completed(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [
        e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == kind
    ]


def test_codex_exec_answers_through_an_agent_with_server_tools(
    clients: Path,
    proxy_url: str,
    upstream: ScriptedUpstream,
    inventory: ToolServer,
    tmp_path: Path,
) -> None:
    upstream.script(call("check_inventory", item="washers"), say_tool_result("In stock: {}"))
    events = codex_exec(clients, proxy_url, tmp_path, "How many washers are in stock?")
    assert [m["text"] for m in completed(events, "agent_message")] == [f"In stock: {STOCK}"]
    assert events[-1]["type"] == "turn.completed"
    assert len(upstream.requests) == 2
    first = upstream.bodies[0]
    names = {t["function"]["name"] for t in first["tools"]}
    assert {"check_inventory", "exec_command"} <= names
    assert {t["type"] for t in first["tools"]} == {"function"}
    assert first["messages"][0]["role"] == "system"
    assert "How many washers are in stock?" in str(first["messages"][-1]["content"])
    assert len(inventory.calls) == 1


def test_codex_runs_its_own_tool_between_server_tools(
    clients: Path,
    proxy_url: str,
    upstream: ScriptedUpstream,
    inventory: ToolServer,
    tmp_path: Path,
) -> None:
    """The proxy returns Codex's `exec_command` call with the server call before it; Codex runs
    the command in its sandbox and sends its whole history back (`store: false`), with the
    server call left out: the run goes on, and the model sees each result once."""
    upstream.script(
        call("check_inventory", item="washers"),
        call("exec_command", cmd="echo approved"),
        say_tool_result("The command said: {}"),
    )
    events = codex_exec(clients, proxy_url, tmp_path, "Check the washers, then run echo.")
    [command] = completed(events, "command_execution")
    assert command["exit_code"] == 0
    [message] = completed(events, "agent_message")
    assert message["text"].startswith("The command said: ")
    assert "approved" in message["text"]
    assert len(upstream.requests) == 3
    results = [str(m["content"]) for m in upstream.bodies[-1]["messages"] if m["role"] == "tool"]
    assert results.count(STOCK) == 1
    assert "approved" in results[-1]
    assert len(inventory.calls) == 1
