"""Engine pods accept only the router and the gateway: the chart's NetworkPolicy and the operator's.

Both policies are read against the labels the pods really carry: the router's and the
gateway's pod templates as the chart renders them, the engine pods as the operator renders
them with the flags the chart gives it, and the namespaces' ``kubernetes.io/metadata.name``.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvfleet.cli import build_parser
from kvfleet.operator import renderers
from kvfleet.operator.cli import config_from_args
from kvfleet.operator.spec import parse_inferenceservice
from kvfleet.operator.testing.chart import render

K8S = "1.35"
RELEASE_NS = "kvfleet-system"
PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
VALUES = {"gateway": {"enabled": True}, "networkPolicy": {"metricsFrom": [PROMETHEUS]}}
Pod = tuple[str, dict[str, str]]  # (namespace, labels)


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels, matchExpressions) against a label set; {} selects all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def admits(policy: dict[str, Any], source: Pod, target: Pod) -> bool:
    """Whether the policy applies to ``target`` and lets ``source`` in (same-namespace rules for bare podSelectors)."""
    spec, policy_ns = policy["spec"], policy["metadata"]["namespace"]
    if target[0] != policy_ns or not matches(spec["podSelector"], target[1]):
        return False
    for rule in spec["ingress"]:
        for peer in rule["from"]:
            ns_ok = (
                matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source[0]})
                if "namespaceSelector" in peer
                else source[0] == policy_ns
            )
            if ns_ok and matches(peer.get("podSelector", {}), source[1]):
                return True
    return False


def chart_pods(docs: list[dict[str, Any]]) -> dict[str, Pod]:
    return {
        d["metadata"]["name"]: (d["metadata"]["namespace"], d["spec"]["template"]["metadata"]["labels"])
        for d in docs
        if d["kind"] == "Deployment"
    }


def operator_children(docs: list[dict[str, Any]], namespace: str, name: str) -> list[dict[str, Any]]:
    """What the operator, run with the chart's flags, renders for an InferenceService."""
    container = chart_deployment(docs, "kvf-operator")["spec"]["template"]["spec"]["containers"][0]
    config = config_from_args(build_parser(only="operator").parse_args(["operator", *container["args"]]))
    spec = parse_inferenceservice({"model": {"name": "tiny", "uri": "file:///opt/kvfleet/models/tiny"}})
    owner = renderers.Owner(name, namespace, "uid")
    return renderers.render_children(owner, spec, "img:1", config.ingress_sources())


def chart_deployment(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


def engine_pod(children: list[dict[str, Any]]) -> Pod:
    dep = next(c for c in children if c["kind"] == "Deployment")
    return dep["metadata"]["namespace"], dep["spec"]["template"]["metadata"]["labels"]


def policies(values: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    docs = render(values, RELEASE_NS)
    charted = [("chart", d) for d in docs if d["kind"] == "NetworkPolicy"]
    rendered = [c for c in operator_children(docs, "team-a", "llama") if c["kind"] == "NetworkPolicy"]
    return [*charted, *(("operator", p) for p in rendered)]


@pytest.mark.parametrize("values", [VALUES, {"operator": {"watchNamespaces": ["team-a", "team-b"]}}])
def test_every_network_policy_is_valid_kubernetes(values: dict[str, Any]) -> None:
    found = policies(values)
    assert [w for w, _ in found].count("operator") == 1 and "chart" in [w for w, _ in found]
    for _, policy in found:
        kubernetes_validate.validate(policy, K8S, strict=True)


def test_engines_admit_the_router_the_gateway_and_the_scrapers_and_no_other_pod() -> None:
    docs = render(VALUES, RELEASE_NS)
    pods = chart_pods(docs)
    router, gateway, operator = pods["kvf-router"], pods["kvf-gateway"], pods["kvf-operator"]
    prometheus = ("monitoring", PROMETHEUS["podSelector"]["matchLabels"])
    children = operator_children(docs, RELEASE_NS, "llama")
    engine, other_engine = engine_pod(children), engine_pod(operator_children(docs, RELEASE_NS, "other"))
    charted = next(d for d in docs if d["kind"] == "NetworkPolicy")
    own = next(c for c in children if c["kind"] == "NetworkPolicy")
    for policy in (charted, own):
        assert [admits(policy, p, engine) for p in (router, gateway, prometheus)] == [True] * 3
        strangers = [operator, other_engine, ("default", router[1]), ("monitoring", {"app": "x"})]
        assert not any(admits(policy, p, engine) for p in strangers)
        assert not admits(policy, router, operator), "the policy guards engine pods only"
    assert not admits(own, router, other_engine), "an InferenceService's policy guards its own pods"


def test_the_operator_guards_engines_in_every_namespace_the_chart_cannot_name() -> None:
    docs = render(VALUES, RELEASE_NS)
    router = chart_pods(docs)["kvf-router"]
    children = operator_children(docs, "team-z", "llama")
    own = next(c for c in children if c["kind"] == "NetworkPolicy")
    assert [c["kind"] for c in children][0] == "NetworkPolicy", "applied before any engine pod exists"
    assert admits(own, router, engine_pod(children))
    assert not admits(own, ("team-z", router[1]), engine_pod(children))


def test_without_the_value_neither_the_chart_nor_the_operator_renders_a_policy() -> None:
    off = {"networkPolicy": {"enabled": False}}
    assert not [w for w, _ in policies(off)]
