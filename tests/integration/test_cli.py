"""`loopwarden check` and `loopwarden demo`."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import main
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
