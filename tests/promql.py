"""PromQL in the dashboards and rules: the expressions, made concrete, and the series they read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).parents[1] / "dashboards"


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels() -> list[tuple[str, dict[str, Any]]]:
    return [(name, p) for name, d in dashboards().items() for p in d["panels"]]


def concrete(expr: str, rate_interval: str = "1m", range_: str = "1h") -> str:
    """The expression as Grafana sends it, with every variable set to "all"."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
    return re.sub(r"\$\{?(namespace|job|instance|agent|model)\}?", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """The series an expression selects (a name followed by `{` or `[`) and the recorded
    rules it reads."""
    selected = set(re.findall(r"\b([a-zA-Z_][a-zA-Z0-9_]*)\s*[{\[]", expr))
    return selected | set(re.findall(r"\bloopwarden:[a-z0-9_:]+", expr))
