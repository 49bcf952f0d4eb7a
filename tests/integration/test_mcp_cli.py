"""`kind: mcp` in the config, `loopwarden check` (without connecting), `loopwarden tools`
(connecting), and the demo's MCP scene (SPEC §3, §13)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.cli import main
from proxy.config import ConfigError, parse_config
from tests.integration.conftest import CheckConfig
from tests.mcp_config import stdio_entry


def write(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "loopwarden.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def problems(config: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(config)
    return [f"{where}: {message}" for where, message in caught.value.problems]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"kind": "mcp"}, "needs url (streamable HTTP) or command (stdio)"),
        ({"kind": "mcp", "url": "http://a/mcp", "command": ["x"]}, "needs url"),
        ({"kind": "mcp", "url": "ftp://a"}, "url: must be an http:// or https:// URL"),
        ({"kind": "mcp", "command": []}, "command must name a program"),
        ({"kind": "mcp", "command": ["x"], "headers_env": {"A": "B"}}, "headers_env is for a url"),
        ({"kind": "mcp", "url": "http://a/mcp", "env_env": {"A": "B"}}, "env_env is for a command"),
        ({"kind": "mcp", "url": "http://a", "include": ["a"], "exclude": ["b"]}, "not both"),
        ({"kind": "mcp", "url": "http://a", "terminal": True}, "terminal lists the tools"),
        ({"kind": "mcp", "url": "http://a", "parameters": {}}, "parameters: not for kind mcp"),
        ({"kind": "http", "url": "http://a", "prefix": "x_"}, "prefix: only for kind mcp"),
        ({"kind": "http", "url": "http://a", "terminal": ["a"]}, "a list is for kind mcp"),
    ],
)
def test_mcp_entries_are_checked(entry: dict[str, Any], expected: str) -> None:
    found = problems({"tools": {"gh": entry}})
    assert any(p.startswith("tools.gh") and expected in p for p in found), found


@pytest.mark.parametrize("field", ["include", "exclude"])
def test_an_entry_that_is_no_name_in_include_or_exclude_is_named(field: str) -> None:
    """An agent naming the entry's tools has them looked up before the entry's own fields."""
    entry = {"kind": "mcp", "url": "http://gh/mcp", field: [[1]]}
    agents = {"a": {"model": "m", "tools": ["search"]}}
    found = problems({"tools": {"gh": entry}, "agents": agents})
    assert f"tools.gh.{field}[0]: must be a string" in found


def test_agents_may_name_the_entry_or_names_it_could_expose() -> None:
    entry = {"kind": "mcp", "url": "http://gh/mcp", "prefix": "gh_", "exclude": ["delete_repo"]}
    agents = {
        "a": {"model": "m", "tools": ["gh", "gh_search_issues"]},
        "b": {"model": "m", "tools": ["gh_delete_repo", "search_issues"]},
    }
    found = problems({"tools": {"gh": entry}, "agents": agents})
    assert found == [
        "agents.b.tools[0]: no tool named 'gh_delete_repo'",
        "agents.b.tools[1]: no tool named 'search_issues'",
    ]


def test_check_validates_entries_without_connecting(
    check_config: CheckConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GH_TOKEN", "secret")
    tools = {
        # Nothing listens there, and check does not try.
        "gh": {"kind": "mcp", "url": "http://127.0.0.1:9/mcp", "headers_env": {"A": "GH_TOKEN"}},
        "local": {"kind": "mcp", "command": [sys.executable, "-c", "raise SystemExit(1)"]},
    }
    agents = {
        "a": {
            "model": "m",
            "tools": ["gh", "fetch_page"],
            "tool_rules": [{"type": "run_first", "tool_name": "fetch_page"}],
        }
    }
    good = check_config({"tools": tools, "agents": agents})
    assert (good.status, good.out) == (0, "config OK\n"), good.err
    tools["gh"]["headers_env"] = {"A": "NOT_SET_ANYWHERE"}
    tools["local"]["command"] = ["no-such-program-here"]
    status, _, err = check_config({"tools": tools})
    assert status == 1
    assert "tools.gh.headers_env.A: environment variable NOT_SET_ANYWHERE is not set" in err
    assert "tools.local: command: no program 'no-such-program-here'" in err


def test_tools_lists_every_exposed_tool_with_its_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tools = {
        "srv": stdio_entry(include=["echo", "forecast"], terminal=["forecast"]),
        "final_answer": {"kind": "builtin"},
    }
    assert main(["tools", "--config", write(tmp_path, {"tools": tools})]) == 0
    out = capsys.readouterr().out
    assert "t_echo  (mcp: srv)\n  Says the text back.\n  {\n" in out
    assert '  "required": [\n      "text"\n    ],' in out
    assert "t_forecast  (mcp: srv, terminal)" in out
    assert "final_answer  (builtin, terminal)" in out
    assert "t_fail" not in out


def test_tools_says_which_source_did_not_connect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tools = {"gone": {"kind": "mcp", "command": [sys.executable, "-c", "pass"]}}
    assert main(["tools", "--config", write(tmp_path, {"tools": tools})]) == 1
    assert "tools.gone: MCP server 'gone'" in capsys.readouterr().err


def test_the_demo_runs_a_tool_of_its_mcp_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    scene = out.split("── A tool of an MCP server (stdio)", 1)[1].split("\n\n", 1)[0]
    assert 'answer      : Here is what I found: {"city":"Oslo","sunrise":"08:57"}' in scene
    assert "stop_reason : completed" in scene
    assert 'loopwarden_tool_calls_total{outcome="ok",tool="sunrise"} 1' in out
