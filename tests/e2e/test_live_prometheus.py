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
from proxy.demo.scenes import DEMO_CONFIG
from tests.promql import concrete, panels

pytestmark = pytest.mark.e2e

SCRAPE_S = 1


@pytest.fixture(scope="module")
def scraped_proxy(scripted_upstream: str) -> Iterator[str]:
    config = dict(DEMO_CONFIG, upstreams={"scripted": {"base_url": scripted_upstream}})
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


LOAD: list[dict[str, Any]] = [
    {
        "model": "weather",
        "messages": [{"role": "user", "content": "get_weather in Paris, then to_fahrenheit"}],
    },
    {
        "model": "weather",
        "stream": True,
        "messages": [{"role": "user", "content": "get_weather in Oslo"}],
    },
    {"model": "researcher", "messages": [{"role": "user", "content": "keep calling search_notes"}]},
    {
        "model": "scripted",
        "messages": [{"role": "user", "content": "Just say hello."}],
        "loop": {"tools": ["final_answer"], "terminating_config": {"tool_ids": ["final_answer"]}},
    },
]


def query(prometheus: str, expr: str) -> dict[str, Any]:
    response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body: dict[str, Any] = response.json()
    return body


def test_every_dashboard_query_runs_and_the_core_panels_have_data(
    scraped_proxy: str, prometheus: str
) -> None:
    with httpx.Client(base_url=scraped_proxy, timeout=30) as client:
        deadline = time.monotonic() + 8  # bounded: a few runs a second for 8 s
        while time.monotonic() < deadline:
            for body in LOAD:
                assert client.post("/v1/chat/completions", json=body).status_code == 200
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
