"""The Grafana dashboards: variables, units, descriptions, rate intervals, and PromQL that
parses (`promtool check rules`) and reads only series the proxy exposes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import Proxy
from tests.integration.test_prometheus_rules import exposition, promtool
from tests.promql import DASHBOARDS, concrete, dashboards, metric_names, panels

TITLES = {
    "runs.json": "Loopwarden — Runs: why they stop",
    "tools-tokens-cost.json": "Loopwarden — Tools, tokens and cost",
    "upstreams.json": "Loopwarden — Upstreams",
}


def test_the_three_dashboards_are_there_with_their_variables() -> None:
    found = dashboards()
    assert {name: d["title"] for name, d in found.items()} == TITLES
    for dashboard in found.values():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert set(variables) == {"datasource", "namespace", "job", "instance", "agent", "model"}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert len({d["uid"] for d in found.values()}) == 3


@pytest.mark.parametrize(
    ("name", "panel"), panels(), ids=[f"{n}:{p['title']}" for n, p in panels()]
)
def test_every_panel_has_a_unit_a_description_and_rate_intervals(name: str, panel: dict) -> None:
    assert panel["fieldConfig"]["defaults"]["unit"]
    assert len(panel["description"]) > 20
    assert panel["datasource"]["uid"] == "${datasource}"
    for target in panel["targets"]:
        expr = target["expr"]
        for window in re.findall(r"\b(?:rate|increase)\([^\[]*\[([^\]]+)\]", expr):
            assert window in ("$__rate_interval", "$__range"), expr
        assert 'namespace=~"$namespace", job=~"$job"' in expr
        if "[$__range]" in expr:  # one value for the range: a range query computed it each step
            assert (target.get("instant"), target.get("range")) == (True, False), expr


def test_runs_dashboard_has_the_panels_operators_ask_for() -> None:
    titles = [p["title"] for p in dashboards()["runs.json"]["panels"]]
    for wanted in (
        "stop reason",
        "Share",
        "Steps per run",
        "Tool calls per run",
        "duration",
        "Nudges",
        "Budget-stop ratio",
    ):
        assert any(wanted in t for t in titles), wanted


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": concrete(t["expr"])}
        for i, (_, p) in enumerate(panels())
        for t in p["targets"]
    ]
    path = tmp_path / "dashboard_exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = promtool("check", "rules", "--lint=none", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout + result.stderr


async def test_every_series_a_dashboard_reads_is_exposed(proxy: Proxy) -> None:
    text = await exposition(proxy)
    exposed = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", text, re.M))
    for _, panel in panels():
        for target in panel["targets"]:
            missing = metric_names(target["expr"]) - exposed
            assert not missing, (panel["title"], missing)


def test_the_provisioning_files_point_grafana_at_the_dashboards() -> None:
    provider = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards.yaml").read_text())
    assert provider["providers"][0]["type"] == "file"
    datasource = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources.yaml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"


async def test_metrics_carry_no_created_series(proxy: Proxy) -> None:
    """Every counter and histogram series had a `_created` twin (twice the series a scrape
    reads), which `/metrics` of several workers has not."""
    text = await exposition(proxy)
    assert "loopwarden_runs_total{" in text
    assert "_created" not in text
