"""The Helm chart: lint, Kubernetes schemas, one process per pod, and what it ships."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from proxy.api.app import create_app
from proxy.config import Config, load_config
from tests.chart import CHART, config_file, container, kinds, one, render
from tests.integration.test_prometheus_rules import promtool
from tests.promql import DASHBOARDS

KUBERNETES = "1.30.0"
PROJECT = tomllib.loads((CHART.parents[1] / "pyproject.toml").read_text())["project"]
REDIS = {"state": {"backend": "redis", "url_env": "REDIS_URL"}}
EVERYTHING = {
    "replicaCount": 3,
    "config": REDIS,
    "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
    "dashboards": {"enabled": True},
}


def test_helm_lint_finds_no_warning() -> None:
    for values in ({}, EVERYTHING):
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize(
    "values", [{}, EVERYTHING, {"autoscaling": {"enabled": True}, "config": REDIS}]
)
def test_every_builtin_manifest_matches_the_kubernetes_schema(values: dict[str, Any]) -> None:
    for manifest in render(values):
        if manifest["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # Prometheus Operator CRDs: checked below against what they carry
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)


def test_the_defaults_run_one_replica_with_one_process() -> None:
    manifests = render()
    assert kinds(manifests) == ["ConfigMap", "Deployment", "Service", "ServiceAccount"]
    assert one(manifests, "Deployment")["spec"]["replicas"] == 1
    main = container(manifests)
    assert main["command"] == ["loopwarden", "serve"]
    assert main["args"][main["args"].index("--workers") + 1] == "1"
    assert main["image"] == "loopwarden:0.1.0"


def test_workers_run_that_many_processes_in_each_pod() -> None:
    main = container(render({"workers": 4}))
    assert main["args"][main["args"].index("--workers") + 1] == "4"


def test_the_chart_and_the_package_have_one_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == PROJECT["version"]


def test_the_probes_and_the_scrape_path_are_routes_of_the_app() -> None:
    manifests = render(EVERYTHING)
    main = container(manifests)
    paths = {
        main[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert paths == {"/healthz", "/readyz"}
    assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"  # it pings the state backend
    (endpoint,) = one(manifests, "ServiceMonitor")["spec"]["endpoints"]
    routes = {getattr(r, "path", None) for r in create_app(Config()).routes}
    assert paths | {endpoint["path"]} <= routes
    ports = {port["name"]: port["containerPort"] for port in main["ports"]}
    assert ports == {"http": 8080, "probes": 8081}
    probes = {
        main[p]["httpGet"]["port"] for p in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes == {endpoint["port"]} == {"probes"}  # not the port clients may fill
    args = main["args"]
    assert args[args.index("--probe-port") + 1] == "8081"
    services = {
        m["metadata"]["name"]: ({p["name"] for p in m["spec"]["ports"]}, m["metadata"]["labels"])
        for m in manifests
        if m["kind"] == "Service"
    }
    assert services["lw-loopwarden"][0] == {"http"}  # clients never reach the probe port
    ports, labels = services["lw-loopwarden-metrics"]
    assert ports == {"probes"}
    selector = one(manifests, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert not selector.items() <= services["lw-loopwarden"][1].items()
    long = render(EVERYTHING, release="r" * 53)  # its full name is 63 characters long
    names = [m["metadata"]["name"] for m in long if m["kind"] == "Service"]
    assert max(len(name) for name in names) <= 63
    assert any(name.endswith("-metrics") for name in names)


def test_the_default_config_is_the_built_in_default(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(config_file(render()))
    assert load_config(str(tmp_path / "config.yaml")) == Config()


def test_the_rendered_config_is_a_valid_loopwarden_config(tmp_path: Path) -> None:
    config = {
        "upstreams": {"local": {"base_url": "http://vllm:8000/v1"}},
        "default_upstream": "local",
        "agents": {"helper": {"model": "qwen", "tools": ["final_answer"], "max_steps": 5}},
        "tools": {"final_answer": {"kind": "builtin"}},
    }
    text = config_file(render({"config": config}))
    assert yaml.safe_load(text) == config
    (tmp_path / "config.yaml").write_text(text)
    loaded = load_config(str(tmp_path / "config.yaml"))
    assert loaded.agents["helper"].max_steps == 5


def test_a_config_change_rolls_the_pods() -> None:
    def checksum(values: dict[str, Any]) -> str:
        pod = one(render(values), "Deployment")["spec"]["template"]
        return str(pod["metadata"]["annotations"]["checksum/config"])

    assert checksum({}) == checksum({})
    assert checksum({}) != checksum({"config": {"state": {"backend": "memory"}}})


@pytest.mark.parametrize(
    "values",
    [{"replicaCount": 2}, {"autoscaling": {"enabled": True}, "config": {"state": {}}}],
)
def test_several_pods_need_the_redis_backend(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmRenderError, match=r"config\.state\.backend: must be redis"):
        render(values)


def test_several_workers_need_a_backend_they_share() -> None:
    memory = {"config": {"state": {"backend": "memory"}}}
    with pytest.raises(helm.HelmRenderError, match=r"memory is per process: with workers above"):
        render({"workers": 2, **memory})
    assert one(render({"workers": 1, **memory}), "Deployment")


def test_the_service_may_listen_on_a_port_the_container_cannot() -> None:
    """A Service on 80: the container, without root or capabilities, listens above 1023."""
    for service in ({"port": 80}, {"port": 80, "containerPort": 9090}):
        container = one(render({"service": service}), "Deployment")["spec"]["template"]["spec"][
            "containers"
        ][0]
        assert container["ports"][0]["containerPort"] == service.get("containerPort", 8080)
    manifests = render({"service": {"port": 80, "containerPort": 8080}})
    assert one(manifests, "Service")["spec"]["ports"][0] == {
        "name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"
    }  # fmt: skip
    container = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--port") + 1] == "8080"
    assert container["ports"][0]["containerPort"] == 8080
    with pytest.raises(helm.HelmValuesError, match="/service/containerPort"):
        render({"service": {"port": 80, "containerPort": 80}})


def test_the_probe_port_must_differ_from_the_service_port() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"service\.probePort: must differ"):
        render({"service": {"port": 8080, "probePort": 8080}})


def test_several_pods_get_a_disruption_budget_and_the_autoscaler_owns_replicas() -> None:
    manifests = render({"replicaCount": 2, "config": REDIS})
    assert one(manifests, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    scaled = render({"autoscaling": {"enabled": True, "maxReplicas": 4}, "config": REDIS})
    assert "replicas" not in one(scaled, "Deployment")["spec"]
    assert one(scaled, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] == 4


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"replicaCount": 0}, "/replicaCount"),
        ({"replicas": 2}, "additional properties 'replicas'"),
        ({"service": {"port": "8080"}}, "/service/port"),
        ({"config": {"state": {"backend": "postgres"}}}, "/config/state/backend"),
        ({"metrics": {"serviceMonitor": {"enable": True}}}, "'enable'"),
        ({"config": {"server": None}}, "/config/server"),  # the proxy refuses it: a crash loop
    ],
)
def test_bad_values_are_refused_with_their_path(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(values)
    assert where in str(caught.value)


def test_the_prometheus_rule_is_the_tested_alerts_file(tmp_path: Path) -> None:
    rule = one(render(EVERYTHING), "PrometheusRule")
    shipped = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    assert rule["spec"] == shipped
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule["spec"]))
    result = promtool("check", "rules", str(tmp_path / "rules.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_runbook_links_may_point_where_the_readme_is_served() -> None:
    served = "https://git.example.com/loopwarden/README.md"
    values = {"metrics": {"prometheusRule": {"enabled": True, "runbookUrl": served}}}
    rule = one(render(values), "PrometheusRule")
    links = [
        r["annotations"]["runbook_url"]
        for group in rule["spec"]["groups"]
        for r in group["rules"]
        if "alert" in r
    ]
    assert len(links) >= 9
    assert all(link.startswith(served + "#runbook-") for link in links), links
    with pytest.raises(helm.HelmValuesError, match="runbookUrl"):
        render({"metrics": {"prometheusRule": {"runbookUrl": "README.md"}}})


def test_the_dashboards_config_map_carries_every_dashboard_for_the_sidecar() -> None:
    config_map = next(
        m for m in render(EVERYTHING) if m["metadata"]["name"].endswith("-dashboards")
    )
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = {p.name: json.loads(p.read_text()) for p in DASHBOARDS.glob("*.json")}
    assert len(shipped) == 3
    assert {k: json.loads(v) for k, v in config_map["data"].items()} == shipped


def test_pods_are_annotated_for_scraping_unless_turned_off() -> None:
    pod = one(render({"service": {"probePort": 9000}}), "Deployment")["spec"]["template"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9000"
    assert annotations["prometheus.io/path"] == "/metrics"
    quiet = one(render({"metrics": {"podAnnotations": False}}), "Deployment")["spec"]["template"]
    assert "prometheus.io/scrape" not in quiet["metadata"]["annotations"]
    # A ServiceMonitor scrapes them: annotations too would have every series scraped twice.
    monitored = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    annotated = one(monitored, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in annotated


def test_a_metrics_key_is_scraped_with_a_key() -> None:
    """With `auth.metrics_key`, a scrape without a key is a 401: `up` 0 and LoopwardenDown."""
    keyed = {"auth": {"metrics_key": True}}
    with pytest.raises(helm.HelmRenderError, match=r"metrics\.podAnnotations: .* cannot carry"):
        render({"config": keyed})
    monitor: dict[str, Any] = {"podAnnotations": False, "serviceMonitor": {"enabled": True}}
    with pytest.raises(helm.HelmRenderError, match=r"metrics\.serviceMonitor\.authorization: "):
        render({"config": keyed, "metrics": monitor})
    secret = {"credentials": {"name": "loopwarden-scrape", "key": "token"}}
    monitor["serviceMonitor"]["authorization"] = secret
    [endpoint] = one(render({"config": keyed, "metrics": monitor}), "ServiceMonitor")["spec"][
        "endpoints"
    ]
    assert endpoint["authorization"] == secret
    assert "authorization" not in one(render(EVERYTHING), "ServiceMonitor")["spec"]["endpoints"][0]


def test_the_readme_values_example_renders_a_valid_config(tmp_path: Path) -> None:
    readme = (CHART.parents[1] / "README.md").read_text()
    example = readme.split("```yaml\n# my-values.yaml\n", 1)[1].split("```", 1)[0]
    manifests = render(yaml.safe_load(example))
    assert one(manifests, "Deployment")["spec"]["replicas"] == 3
    assert {"PodDisruptionBudget", "ServiceMonitor", "PrometheusRule"} <= set(kinds(manifests))
    (tmp_path / "config.yaml").write_text(config_file(manifests))
    assert load_config(str(tmp_path / "config.yaml")).state.backend == "redis"


def test_the_image_matches_what_the_pod_expects() -> None:
    """helm/Dockerfile builds the image the chart runs (no Docker engine here to build it):
    its user, working directory and entry point are the ones the chart relies on."""
    dockerfile = (CHART.parent / "Dockerfile").read_text()
    manifests = render()
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    main = container(manifests)
    assert f"--uid {pod['securityContext']['runAsUser']} " in dockerfile
    assert f"USER {pod['securityContext']['runAsUser']}\n" in dockerfile
    assert f"WORKDIR {main['workingDir']}\n" in dockerfile
    assert 'ENTRYPOINT ["loopwarden"]' in dockerfile
    assert PROJECT["scripts"]["loopwarden"] == "proxy.cli:main"


def test_a_stopping_pod_is_let_go_by_the_service_then_drains_its_runs() -> None:
    """The preStop delay serves the connections that still come, the server's drain follows:
    the grace period holds both, and 10 s more to exit."""
    manifests = render()
    assert container(manifests)["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 5 + 30 + 10
    longer = render(
        {"config": {"server": {"shutdown_timeout_s": 600.5}}, "shutdownDelaySeconds": 0}
    )
    assert "lifecycle" not in container(longer)
    pod = one(longer, "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 601 + 10
    pod = one(render({"terminationGracePeriodSeconds": 100}), "Deployment")["spec"]["template"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 100
    with pytest.raises(helm.HelmRenderError, match=r"terminationGracePeriodSeconds: 35 is less"):
        render({"terminationGracePeriodSeconds": 35})  # SIGKILL as the stopped runs let go


@pytest.mark.parametrize("release", ["on", "yes", "123"])
def test_a_release_name_yaml_reads_as_another_type_stays_a_label(release: str) -> None:
    for manifest in render(release=release):
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)
        assert manifest["metadata"]["labels"]["app.kubernetes.io/instance"] == release


def test_the_pod_has_no_api_token_and_probes_that_wait_for_the_state_backend() -> None:
    manifests = render({"config": {"state": {"timeout_s": 7.5}}})
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["shareProcessNamespace"] is True  # orphans are reaped
    main = container(manifests)
    assert main["readinessProbe"]["timeoutSeconds"] == 9  # the backend's 7.5 s, and a second
    assert main["livenessProbe"]["timeoutSeconds"] == 5


def test_bounds_the_api_server_would_refuse_are_refused_as_the_chart_renders() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"autoscaling\.minReplicas: 5 is above"):
        render(
            {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}, "config": REDIS}
        )
    with pytest.raises(helm.HelmValuesError, match="/service/probePort"):
        render({"service": {"probePort": 81}})  # no root to bind it


def test_sqlite_s_file_may_outlive_its_pod_on_a_claim() -> None:
    """On the emptyDir, every rollout started the default backend empty (stored contexts,
    responses, thread counts): on a claim, the pod is replaced, never run beside its successor
    on one file."""
    manifests = render({"persistence": {"enabled": True, "size": "5Gi"}})
    for manifest in manifests:
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)
    claim = one(manifests, "PersistentVolumeClaim")
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    deployment = one(manifests, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"]}
    mine = render({"persistence": {"enabled": True, "existingClaim": "mine"}})
    assert "PersistentVolumeClaim" not in kinds(mine)
    volumes = {v["name"]: v for v in one(mine, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "mine"}
    assert "strategy" not in one(render(), "Deployment")["spec"]
    with pytest.raises(helm.HelmRenderError, match=r"persistence\.enabled: one claim is for one"):
        render({"persistence": {"enabled": True}, "replicaCount": 2, "config": REDIS})


def test_the_chart_takes_volumes_names_annotations_and_an_ipv6_address() -> None:
    """Python tools' code and CA bundles needed an image of one's own."""
    values = {
        "fullnameOverride": "gateway",
        "extraVolumes": [{"name": "tools", "configMap": {"name": "my-tools"}}],
        "extraVolumeMounts": [{"name": "tools", "mountPath": "/opt/tools", "readOnly": True}],
        "service": {"annotations": {"team": "agents"}, "listenAddress": "::"},
    }
    manifests = render(values)
    for manifest in manifests:
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)
        assert manifest["metadata"]["name"].startswith("gateway")
    main = container(manifests)
    assert main["args"][main["args"].index("--host") + 1] == "::"
    assert {"name": "tools", "mountPath": "/opt/tools", "readOnly": True} in main["volumeMounts"]
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "tools", "configMap": {"name": "my-tools"}} in pod["volumes"]
    assert one(manifests, "Service")["metadata"]["annotations"] == {"team": "agents"}


@pytest.mark.parametrize(
    ("values", "warned"),
    [
        ({"service": {"type": "LoadBalancer"}}, True),
        (
            {"service": {"type": "NodePort"}, "config": {"auth": {"keys": [{"key_env": "K"}]}}},
            False,
        ),
        ({}, False),
    ],
)
def test_notes_warn_of_a_service_beyond_the_cluster_without_keys(
    values: dict[str, Any], warned: bool
) -> None:
    with helm.Chart.load(CHART) as chart:
        notes = chart.render(values, name="lw", namespace="agents")[
            "loopwarden/templates/NOTES.txt"
        ]
    assert ("WARNING: service.type is" in notes) is warned


@pytest.mark.parametrize(
    ("values", "grace"),
    [
        ({"config": {"server": {"keep_alive_timeout_s": 5}}}, 45),  # the default drain
        ({"config": {"server": {"shutdown_timeout_s": 0}}}, 15),  # no drain: not the default
        ({"terminationGracePeriodSeconds": 100_000_000}, 100_000_000),  # not `1e+08`
    ],
)
def test_the_grace_period_of_values_yaml_may_hold(values: dict[str, Any], grace: int) -> None:
    manifests = render(values)
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == grace
    kubernetes_validate.validate(one(manifests, "Deployment"), KUBERNETES, strict=True)
