"""`loopwarden check` and `loopwarden demo`."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.demo.runner import free_port
from tests.integration.conftest import CheckConfig


def test_check_reports_every_error_with_its_path(check_config: CheckConfig) -> None:
    status, _, err = check_config(
        "default_upstream: nowhere\n"
        "tools:\n  t: {kind: http}\n"
        "agents:\n"
        "  a: {model: m, tools: [ghost], stop_when: [{max_cost: -1}]}\n"
    )
    assert status == 1
    assert "default_upstream: no upstream named 'nowhere'" in err
    assert "agents.a.tools[0]: no tool named 'ghost'" in err
    assert "agents.a.stop_when[0].max_cost: must be greater than 0" in err
    assert "tools.t: an http tool needs url" in err


def test_check_rejects_unknown_keys(check_config: CheckConfig) -> None:
    status, _, err = check_config("server: {port: 8080, colour: blue}\n")
    assert status == 1
    assert "server.colour: unknown field" in err


def test_check_accepts_a_good_config(check_config: CheckConfig) -> None:
    checked = check_config(
        "tools:\n  final_answer: {kind: builtin}\n"
        "agents:\n  a: {model: gpt-4o-mini, tools: [final_answer], "
        "terminating_config: {tool_ids: [final_answer]}}\n"
    )
    assert (checked.status, checked.out) == (0, "config OK\n")


def test_demo_shows_each_stop_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    reasons = ("completed", "terminal_tool", "cost_budget", "max_steps", "nudges_exhausted")
    for reason in (*reasons, "tool_call_limit"):
        assert f"stop_reason : {reason}" in out
    assert "blocked     : " in out
    tree = out.split("── The span tree", 1)[1]
    assert "POST /v1/chat/completions" in tree
    assert "   invoke_agent weather" in tree
    assert tree.count("      chat scripted") == 3
    assert "      execute_tool get_weather" in tree
    assert (
        'loopwarden_runs_total{agent="researcher",model="scripted",stop_reason="cost_budget"} 1'
        in out
    )
    assert 'loopwarden_tool_calls_total{outcome="blocked_rule",tool="to_fahrenheit"} 1' in out
    assert "is not allowed now by the tool rules. Allowed tools: get_weather." in out
    assert "Here is what I found: 69.8°F" in out


def test_the_readme_config_example_is_valid() -> None:
    import yaml

    from proxy.config import parse_config

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    example = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = parse_config(yaml.safe_load(example))
    agent = config.agents["researcher"]
    assert [r.type for r in agent.tool_rules] == ["run_first"]
    assert agent.tool_call_limits[0].thread_limit == 50


def test_the_probe_port_must_be_a_port_of_its_own(
    check_config: CheckConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checked = check_config("server: {port: 8080, probe_port: 8080}\n")
    assert checked.status == 1
    assert "server: probe_port must differ from port" in checked.err
    config = tmp_path / "loopwarden.yaml"
    config.write_text("server: {probe_port: 8081}\n")
    assert main(["serve", "--config", str(config), "--port", "8081"]) == 1
    assert "server: probe_port must differ from port" in capsys.readouterr().err


def test_serve_says_which_port_it_cannot_listen_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "loopwarden.yaml"
    config.write_text("state: {backend: sqlite, path: state.db}\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = ["serve", "--config", str(config), "--host", "127.0.0.1"]
        assert main([*serve, "--port", str(free_port()), "--probe-port", str(port)]) == 1
        assert f"server.probe_port: cannot listen on 127.0.0.1:{port}: " in capsys.readouterr().err
        assert main([*serve, "--port", str(port), "--workers", "2"]) == 1
        assert f"server.port: cannot listen on 127.0.0.1:{port}: " in capsys.readouterr().err
