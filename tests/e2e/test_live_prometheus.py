"""A real Prometheus (Debian's `prometheus`) scrapes the proxy under a short, bounded load; every
dashboard query then runs through its HTTP API."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from proxy.api.app import create_app
from proxy.config import parse_config
from proxy.demo.runner import free_port, serve_in_thread
from tests.bodies import user
from tests.promql import concrete, panels
from tests.scripted_upstream import Keep, ScriptedUpstream, Turn, call, keep, say
from tests.tools import TOOLS

pytestmark = pytest.mark.e2e

SCRAPE_S = 1


@pytest.fixture(scope="module")
def scraped_proxy(upstream_url: str) -> Iterator[str]:
    config = {
        "upstreams": {"scripted": {"base_url": upstream_url, "max_retries": 0}},
        "default_upstream": "scripted",
        "state": {"backend": "memory"},
        "pricing": {"scripted": {"input": 2.0, "output": 8.0}},
        "tools": TOOLS,
        "agents": {
            "weather": {"model": "scripted", "tools": ["get_weather", "to_fahrenheit"]},
            "researcher": {
                "model": "scripted",
                "tools": ["search_notes"],
                "stop_when": [{"max_cost": 0.004}],
            },
        },
    }
    app = create_app(parse_config(config))
    with serve_in_thread(app, free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def prometheus(scraped_proxy: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (apt-get install -y prometheus)")
    folder = tmp_path_factory.mktemp("prometheus")
    target = scraped_proxy.removeprefix("http://")
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [{"job_name": "loopwarden", "static_configs": [{"targets": [target]}]}],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prometheus did not start")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# Each run of the load: its request and the upstream's turns for it.
LOAD: list[tuple[dict[str, Any], tuple[Turn | Keep, ...]]] = [
    (
        {"model": "weather", "messages": user("Paris in Fahrenheit?")},
        (call("get_weather", city="Paris"), call("to_fahrenheit", celsius=18.0), say("64.4°F")),
    ),
    (
        {"model": "weather", "stream": True, "messages": user("Oslo?")},
        (call("get_weather", city="Oslo"), say("4 °C and clear.")),
    ),
    (
        {"model": "researcher", "messages": user("Research Lima.")},
        (keep(call("search_notes", query="Lima")),),  # until the cost budget stops it
    ),
    (
        {
            "model": "scripted",
            "messages": user("Just say hello."),
            "loop": {
                "tools": ["final_answer"],
                "terminating_config": {"tool_ids": ["final_answer"]},
            },
        },
        (say("Hello."), call("final_answer", answer="Hello!")),  # after a nudge
    ),
]


def query(prometheus: str, expr: str) -> dict[str, Any]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body: dict[str, Any] = response.json()
    return body


def test_every_dashboard_query_runs_and_the_core_panels_have_data(
    scraped_proxy: str, prometheus: str, upstream: ScriptedUpstream
) -> None:
    stops: set[str] = set()
    with httpx.Client(base_url=scraped_proxy, timeout=30) as client:
        deadline = time.monotonic() + 8  # bounded: a few runs a second for 8 s
        while time.monotonic() < deadline:
            for body, turns in LOAD:
                upstream.script(*turns)
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
                if not body.get("stream"):
                    stops.add(r.json()["loop"]["stop_reason"])
            time.sleep(0.25)
    time.sleep(3 * SCRAPE_S)  # the last scrapes land
    up = query(prometheus, 'up{job="loopwarden"}')
    assert up["data"]["result"][0]["value"][1] == "1"
    empty = []
    for _, panel in panels():
        for target in panel["targets"]:
            expr = concrete(target["expr"], rate_interval="10s", range_="5m")
            result = query(prometheus, expr)
            assert result["status"] == "success", (panel["title"], expr, result)
            if "core" in panel.get("tags", []) and not result["data"]["result"]:
                empty.append(panel["title"])
    assert empty == []
    assert stops == {"completed", "cost_budget", "terminal_tool"}
