"""The alert rules, their promtool tests, and the exposition they read (Debian's `promtool`)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.bodies import user
from tests.integration.conftest import Proxy
from tests.promql import DASHBOARDS, metric_names
from tests.scripted_upstream import call, say


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    if binary is None:
        raise RuntimeError("promtool is not installed (apt-get install -y prometheus)")
    return subprocess.run(
        [binary, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_rules_load() -> None:
    result = promtool("check", "rules", str(DASHBOARDS / "alerts.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", str(DASHBOARDS / "alerts.test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    groups = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert len(alerts) == 13
    for alert in alerts:
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert set(alert["annotations"]) == {"summary", "description", "runbook_url"}
    tested = (DASHBOARDS / "alerts.test.yml").read_text()
    for alert in alerts:
        assert f"alertname: {alert['alert']}" in tested


def test_the_readme_names_every_alert_and_has_its_runbook() -> None:
    groups = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    readme = (DASHBOARDS.parent / "README.md").read_text()
    listed = readme.split("`dashboards/alerts.yml` holds recording rules and ", 1)[1]
    listed = listed.split("each with", 1)[0]
    assert listed.startswith("thirteen alerts")
    assert len(alerts) == 13
    for alert in alerts:
        assert f"`{alert['alert']}`" in listed
        anchor = alert["annotations"]["runbook_url"].rsplit("#", 1)[1]
        assert f'<a id="{anchor}"></a>' in readme, anchor


async def exposition(proxy: Proxy) -> str:
    """The exposition after a tool loop and a streamed run."""
    proxy.upstream.script(
        call("get_weather", city="Paris"),
        call("to_fahrenheit", celsius=18.0),
        say("64.4°F in Paris."),
        say("Hi."),
    )
    await proxy.chat(model="weather", messages=user("Paris in Fahrenheit?"))
    await proxy.chat(model="weather", stream=True)
    return str((await proxy.client.get("/metrics")).text)


async def test_the_exposition_passes_promtool_check_metrics(proxy: Proxy) -> None:
    text = await exposition(proxy)
    result = promtool("check", "metrics", stdin=text)
    assert result.returncode == 0, result.stdout + result.stderr


async def test_every_metric_a_rule_reads_is_exposed_or_recorded(proxy: Proxy) -> None:
    text = await exposition(proxy)
    exposed = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.M))
    groups = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    for rule in rules:
        for name in metric_names(rule["expr"]) - {"up"}:
            assert name in exposed or name in recorded, f"{name} in {rule['expr']}"
    assert any(
        n.startswith("loopwarden:")
        for r in rules
        for n in re.findall(r"loopwarden:[a-z0-9_:]+", r["expr"])
    )


@pytest.mark.parametrize("name", ["loopwarden_runs_total", "gen_ai_client_token_usage_bucket"])
async def test_core_series_are_in_the_exposition(proxy: Proxy, name: str) -> None:
    assert f"\n{name}{{" in await exposition(proxy)
