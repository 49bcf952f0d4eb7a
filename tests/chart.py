"""The Helm chart in helm/loopwarden, rendered offline by Helm's own Go SDK (helm-python-sdk)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART = Path(__file__).parents[1] / "helm" / "loopwarden"


def render(values: dict[str, Any] | None = None, release: str = "lw") -> list[dict[str, Any]]:
    """The manifests `helm template` would print: every non-empty document, NOTES excluded."""
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values or {}, name=release, namespace="agents")
    return [
        doc
        for name, text in sorted(files.items())
        if not name.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def one(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """The Deployment's one container."""
    (main,) = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(main)


def kinds(manifests: list[dict[str, Any]]) -> list[str]:
    return sorted(m["kind"] for m in manifests)


def config_file(manifests: list[dict[str, Any]]) -> str:
    """The Loopwarden config file the chart mounts."""
    (text,) = [m["data"]["config.yaml"] for m in manifests if "config.yaml" in m.get("data", {})]
    return str(text)
