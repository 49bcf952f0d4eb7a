"""The pods the Helm chart describes, run as processes on 127.0.0.1: their command, config
volume, working directory, environment, probes and scrape endpoint, with the OpenAI SDK."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from proxy.demo.runner import free_port
from tests.chart import container, one, render
from tests.e2e.conftest import running
from tests.scripted_upstream import ScriptedUpstream, call, say
from tests.tools import TOOLS

pytestmark = pytest.mark.e2e


@contextlib.contextmanager
def pod(manifests: list[dict[str, Any]], root: Path) -> Iterator[dict[str, str]]:
    """The Deployment's pod on 127.0.0.1, its volumes as folders under `root` and its ports
    on free ones; yields the base URL of each named port once its startup probe answers."""
    spec = one(manifests, "Deployment")["spec"]["template"]["spec"]
    main = container(manifests)
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_maps = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "ConfigMap"}
    mounts: dict[str, Path] = {}
    for mount in main["volumeMounts"]:
        folder = root / mount["name"]
        folder.mkdir(parents=True)
        if "configMap" in volumes[mount["name"]]:
            config_map = config_maps[volumes[mount["name"]]["configMap"]["name"]]
            for name, text in config_map["data"].items():
                (folder / name).write_text(text)
        mounts[mount["mountPath"]] = folder

    def local(arg: str) -> str:
        for path, folder in mounts.items():
            if arg.startswith(path):
                return str(folder) + arg[len(path) :]
        return arg

    args = [local(a) for a in main["args"]]
    args[args.index("--host") + 1] = "127.0.0.1"
    bases = {}
    for port in main["ports"]:  # each given on the command line as its containerPort
        (at,) = [i for i, arg in enumerate(args) if arg == str(port["containerPort"])]
        args[at] = str(free_port())
        bases[port["name"]] = f"http://127.0.0.1:{args[at]}"
    executable = Path(sys.executable).parent / main["command"][0]
    env = {e["name"]: e["value"] for e in main.get("env", [])}
    probe = main["startupProbe"]["httpGet"]
    command = [str(executable), *main["command"][1:], *args]
    with running(command, bases[probe["port"]] + probe["path"], env, cwd=local(main["workingDir"])):
        yield bases


def runs_total(url: str, agent: str) -> float:
    text = httpx.get(url).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "loopwarden_runs"
        for sample in family.samples
        if sample.name == "loopwarden_runs_total" and sample.labels["agent"] == agent
    )


def test_the_charts_pods_serve_share_redis_and_are_scraped_one_process_each(
    upstream: ScriptedUpstream, redis_url: str, tmp_path: Path
) -> None:
    paris = [call("get_weather", city="Paris"), call("to_fahrenheit", celsius=18.0), say("64.4°F")]
    upstream.script(*paris * 5, call("get_weather", city="Oslo"), say("4 °C and clear."))
    config = {
        "upstreams": {"scripted": {"base_url": upstream.url, "max_retries": 0}},
        "default_upstream": "scripted",
        "tools": TOOLS,
        "agents": {"weather": {"model": "scripted", "tools": ["get_weather", "to_fahrenheit"]}},
        "state": {"backend": "redis", "url_env": "REDIS_URL", "key_prefix": "helm-pods:"},
    }
    values = {
        "replicaCount": 2,
        "config": config,
        "env": [{"name": "REDIS_URL", "value": redis_url}],
        "metrics": {"serviceMonitor": {"enabled": True}},
    }
    manifests = render(values)
    replicas = one(manifests, "Deployment")["spec"]["replicas"]
    main = container(manifests)
    (endpoint,) = one(manifests, "ServiceMonitor")["spec"]["endpoints"]
    with contextlib.ExitStack() as stack:
        ports = [stack.enter_context(pod(manifests, tmp_path / f"pod{i}")) for i in range(replicas)]
        pods = [port["http"] for port in ports]
        for port in ports:
            for probe in ("livenessProbe", "readinessProbe"):
                get = main[probe]["httpGet"]
                assert httpx.get(port[get["port"]] + get["path"]).status_code == 200
        for i in range(5):
            with OpenAI(base_url=f"{pods[i % 2]}/v1", api_key="x", max_retries=0) as client:
                reply = client.chat.completions.create(
                    model="weather",
                    messages=[{"role": "user", "content": "Paris in Fahrenheit?"}],
                )
            assert reply.choices[0].finish_reason == "stop"
        assert endpoint["path"] == "/metrics"
        scraped = [
            runs_total(port[endpoint["port"]] + endpoint["path"], "weather") for port in ports
        ]
        assert scraped == [3.0, 2.0]  # each pod counts its own runs; Prometheus sums them
        chat = {"context_id": "helm-c1", "agent": "weather", "message": "Oslo?"}
        assert httpx.post(f"{pods[0]}/chat", json=chat, timeout=30).status_code == 200
        stored = httpx.get(f"{pods[1]}/v1/contexts/helm-c1").json()  # one redis for all pods
        assert stored["messages"][0] == {"role": "user", "content": "Oslo?"}
        assert [m["role"] for m in stored["messages"]][1:] == ["assistant", "tool", "assistant"]


def test_a_single_pod_keeps_sqlite_state_on_its_data_volume(
    upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    upstream.script(call("get_weather", city="Oslo"), say("4 °C and clear."))
    config = {
        "upstreams": {"scripted": {"base_url": upstream.url, "max_retries": 0}},
        "default_upstream": "scripted",
        "tools": TOOLS,
        "agents": {"weather": {"model": "scripted", "tools": ["get_weather"]}},
    }
    manifests = render({"config": config})
    with pod(manifests, tmp_path) as ports:
        base = ports["http"]
        chat = {"context_id": "c-sqlite", "agent": "weather", "message": "Oslo?"}
        assert httpx.post(f"{base}/chat", json=chat, timeout=30).status_code == 200
    assert (tmp_path / "data" / "loopwarden.db").stat().st_size > 0
    assert not (tmp_path / "config" / "loopwarden.db").exists()
