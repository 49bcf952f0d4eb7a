"""The Helm chart's access objects: the Ingress, the NetworkPolicy and the ServiceAccount."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.chart import CHART, kinds, one, render

KUBERNETES = "1.30.0"
INGRESS_NGINX = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
CLIENTS = {"podSelector": {"matchLabels": {"role": "agent-client"}}}
DNS = {
    "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
    "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
}
HTTPS_OUT = {
    "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}],
    "ports": [{"port": 443, "protocol": "TCP"}],
}
INGRESS = {
    "enabled": True,
    "className": "nginx",
    "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"},
    "hosts": [
        {
            "host": "lw.example.com",
            "paths": [
                {"path": "/v1", "pathType": "Prefix"},
                {"path": "/chat", "pathType": "Exact"},
            ],
        },
        {"host": "*.agents.example.com"},  # paths: / by default
    ],
    "tls": [{"hosts": ["lw.example.com"], "secretName": "lw-tls"}],
}
ALL_ON = {
    "ingress": INGRESS,
    "networkPolicy": {
        "enabled": True,
        "ingressFrom": [INGRESS_NGINX, CLIENTS],
        "metricsFrom": [MONITORING],
        "egress": [DNS, HTTPS_OUT],
    },
    "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "lw@p.iam"}},
}


def pod_spec(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(one(manifests, "Deployment")["spec"]["template"]["spec"])


def valid(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for manifest in manifests:
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)
    return manifests


def test_the_defaults_render_a_service_account_and_no_ingress_or_network_policy() -> None:
    manifests = valid(render())
    assert kinds(manifests) == ["ConfigMap", "Deployment", "Service", "ServiceAccount"]
    account = one(manifests, "ServiceAccount")
    assert account["metadata"]["name"] == "lw-loopwarden"
    assert account["automountServiceAccountToken"] is False
    assert "annotations" not in account["metadata"]
    pod = pod_spec(manifests)
    assert pod["serviceAccountName"] == "lw-loopwarden"
    assert pod["automountServiceAccountToken"] is False  # still no API token in the pod


def test_every_access_object_matches_the_kubernetes_schema_and_lints() -> None:
    manifests = valid(render(ALL_ON))
    assert {"Ingress", "NetworkPolicy", "ServiceAccount"} <= set(kinds(manifests))
    report = helm.lint(CHART, ALL_ON, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_the_ingress_sends_its_hosts_and_paths_to_the_client_port() -> None:
    """The Service's port (80 here; the container listens on 8080), never the probe port."""
    manifests = valid(render({"ingress": INGRESS, "service": {"port": 80}}))
    ingress = one(manifests, "Ingress")
    assert ingress["metadata"]["name"] == "lw-loopwarden"
    assert ingress["metadata"]["annotations"] == INGRESS["annotations"]
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"hosts": ["lw.example.com"], "secretName": "lw-tls"}]
    routes = [
        (rule.get("host"), path["path"], path["pathType"], path["backend"])
        for rule in ingress["spec"]["rules"]
        for path in rule["http"]["paths"]
    ]
    to_service = {"service": {"name": "lw-loopwarden", "port": {"number": 80}}}
    assert routes == [
        ("lw.example.com", "/v1", "Prefix", to_service),
        ("lw.example.com", "/chat", "Exact", to_service),
        ("*.agents.example.com", "/", "Prefix", to_service),
    ]
    service = one(manifests, "Service")
    assert service["metadata"]["name"] == "lw-loopwarden"
    assert [p["port"] for p in service["spec"]["ports"]] == [80]  # its one port: the proxy's


def test_an_ingress_may_take_every_host_and_the_cluster_s_default_class() -> None:
    ingress = one(valid(render({"ingress": {"enabled": True, "hosts": [{"host": ""}]}})), "Ingress")
    assert "ingressClassName" not in ingress["spec"]
    assert "tls" not in ingress["spec"]
    assert "annotations" not in ingress["metadata"]  # no controller's annotations by default
    (rule,) = ingress["spec"]["rules"]
    assert "host" not in rule
    assert [p["path"] for p in rule["http"]["paths"]] == ["/"]


def test_an_ingress_without_hosts_is_refused() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"ingress\.hosts: give at least one host"):
        render({"ingress": {"enabled": True}})


def test_the_network_policy_admits_clients_and_scrapers_on_their_own_ports() -> None:
    values = {
        "networkPolicy": {
            "enabled": True,
            "ingressFrom": [INGRESS_NGINX, CLIENTS],
            "metricsFrom": [MONITORING],
        },
        "service": {"port": 80, "probePort": 9000},  # the container listens on 8080
    }
    manifests = valid(render(values))
    policy = one(manifests, "NetworkPolicy")
    assert policy["metadata"]["name"] == "lw-loopwarden"
    selector = one(manifests, "Deployment")["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["podSelector"] == {"matchLabels": selector}
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress left open
    assert "egress" not in policy["spec"]
    rules = {
        rule["ports"][0]["port"]: (rule["ports"], rule["from"])
        for rule in policy["spec"]["ingress"]
    }
    assert rules == {
        8080: ([{"port": 8080, "protocol": "TCP"}], [INGRESS_NGINX, CLIENTS]),
        9000: ([{"port": 9000, "protocol": "TCP"}], [MONITORING]),
    }
    ports = {p["name"]: p["containerPort"] for p in pod_spec(manifests)["containers"][0]["ports"]}
    assert ports == {"http": 8080, "probes": 9000}


def test_a_network_policy_without_peers_admits_any_on_the_two_ports_only() -> None:
    policy = one(valid(render({"networkPolicy": {"enabled": True}})), "NetworkPolicy")
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": 8080, "protocol": "TCP"}]},
        {"ports": [{"port": 8081, "protocol": "TCP"}]},
    ]
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_egress_is_limited_only_to_the_rules_given() -> None:
    values = {"networkPolicy": {"enabled": True, "egress": [DNS, HTTPS_OUT]}}
    policy = one(valid(render(values)), "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["egress"] == [DNS, HTTPS_OUT]


def test_the_service_account_is_named_annotated_and_mounts_a_token_only_when_asked() -> None:
    values = {
        "serviceAccount": {
            "name": "gateway-identity",
            "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/lw"},
            "automount": True,
        }
    }
    manifests = valid(render(values))
    account = one(manifests, "ServiceAccount")
    assert account["metadata"]["name"] == "gateway-identity"
    assert account["metadata"]["annotations"] == values["serviceAccount"]["annotations"]
    assert account["automountServiceAccountToken"] is True
    pod = pod_spec(manifests)
    assert pod["serviceAccountName"] == "gateway-identity"
    assert pod["automountServiceAccountToken"] is True
    named = render({"fullnameOverride": "gateway"})
    assert one(named, "ServiceAccount")["metadata"]["name"] == "gateway"
    assert pod_spec(named)["serviceAccountName"] == "gateway"


@pytest.mark.parametrize(("name", "used"), [("", "default"), ("existing-sa", "existing-sa")])
def test_an_existing_service_account_is_used_not_made(name: str, used: str) -> None:
    manifests = valid(render({"serviceAccount": {"create": False, "name": name}}))
    assert "ServiceAccount" not in kinds(manifests)
    pod = pod_spec(manifests)
    assert pod["serviceAccountName"] == used
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"ingress": {"enabled": "yes"}}, "/ingress/enabled"),
        ({"ingress": {"hosts": "lw.example.com"}}, "/ingress/hosts"),
        ({"ingress": {"hosts": [{"hostname": "lw.example.com"}]}}, "'hostname'"),
        ({"ingress": {"hosts": [{"host": "LW.example.com"}]}}, "/ingress/hosts/0/host"),
        ({"ingress": {"hosts": [{"paths": [{"path": "v1"}]}]}}, "/ingress/hosts/0/paths/0/path"),
        ({"ingress": {"hosts": [{"paths": ["/v1"]}]}}, "/ingress/hosts/0/paths/0"),
        (
            {"ingress": {"hosts": [{"paths": [{"path": "/", "pathType": "prefix"}]}]}},
            "/ingress/hosts/0/paths/0/pathType",
        ),
        ({"ingress": {"tls": [{"secretName": 5}]}}, "/ingress/tls/0/secretName"),
        ({"ingress": {"tls": {"secretName": "lw-tls"}}}, "/ingress/tls"),
        ({"ingress": {"annotations": {"timeout": 3600}}}, "/ingress/annotations/timeout"),
        ({"networkPolicy": {"enabled": 1}}, "/networkPolicy/enabled"),
        ({"networkPolicy": {"ingressFrom": CLIENTS}}, "/networkPolicy/ingressFrom"),
        ({"networkPolicy": {"ingressFrom": [{"podSelecter": {}}]}}, "'podSelecter'"),
        ({"networkPolicy": {"metricsFrom": [{"ipBlock": {}}]}}, "/networkPolicy/metricsFrom/0"),
        ({"networkPolicy": {"egress": "all"}}, "/networkPolicy/egress"),
        (
            {"networkPolicy": {"egress": [{"ports": [{"port": 53, "protocol": "udp"}]}]}},
            "/networkPolicy/egress/0/ports/0/protocol",
        ),
        ({"networkPolicy": {"egres": []}}, "'egres'"),
        ({"serviceAccount": {"create": "true"}}, "/serviceAccount/create"),
        ({"serviceAccount": {"automount": "false"}}, "/serviceAccount/automount"),
        ({"serviceAccount": {"name": "Gateway_SA"}}, "/serviceAccount/name"),
        ({"serviceAccount": {"annotations": ["a"]}}, "/serviceAccount/annotations"),
        ({"serviceAccount": {"automountServiceAccountToken": True}}, "'automountService"),
    ],
)
def test_bad_access_values_are_refused_with_their_path(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        render(values)
    assert where in str(caught.value)


KEYS = {"keys": [{"key_env": "K"}]}


@pytest.mark.parametrize(
    ("values", "warned", "noted"),
    [
        ({}, True, True),
        ({"config": {"auth": KEYS}}, False, True),
        (
            {
                "config": {"auth": {**KEYS, "metrics_key": True}},
                "metrics": {"podAnnotations": False},
            },
            False,
            False,
        ),
    ],
)
def test_notes_show_the_ingress_and_warn_of_what_it_opens(
    values: dict[str, Any], warned: bool, noted: bool
) -> None:
    with helm.Chart.load(CHART) as chart:
        notes = chart.render({"ingress": INGRESS, **values}, name="lw", namespace="agents")[
            "loopwarden/templates/NOTES.txt"
        ]
    assert "https://lw.example.com/v1" in notes  # its TLS host
    assert "http://*.agents.example.com/" in notes
    assert ("WARNING: the Ingress reaches beyond the cluster" in notes) is warned
    assert ("serves /metrics too" in notes) is noted
