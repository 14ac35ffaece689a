"""Least privilege: the chart grants the operator exactly the (group, resource, verb) triples
that the operator and kopf send in a full lifecycle on the emulated API server.

The lifecycle touches every code path that calls the API: a model PVC missing then
created, children created, a rollout, a scale, a TenantQuota whose Secret appears later,
deletion; with peering on, as the chart deploys it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.kube import USER_AGENT
from kvfleet.operator.testing.apiserver import ApiServer, serve
from kvfleet.operator.testing.chart import render
from kvfleet.operator.testing.cluster import User, inferenceservice, roll_out, tenantquota
from kvfleet.operator.testing.harness import eventually, kubeconfig_for, running_operator, settle

Triple = tuple[str, str, str]
DISCOVERY = {"api", "apis", "version"}


def permission(method: str, path: str, params: dict[str, str]) -> Triple | None:
    """The RBAC (apiGroup, resource[/subresource], verb) a request needs; None for discovery."""
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        assert parts[0] in DISCOVERY, path
        return None
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method)
    if method == "GET":
        verb = "watch" if params.get("watch") == "true" else "get" if name else "list"
    assert verb is not None, (method, path)
    return group, f"{resource}/{sub}" if sub else resource, verb


def operator_permissions(server: ApiServer) -> set[Triple]:
    agents = ("kopf/", USER_AGENT)
    seen = {
        permission(r.method.value.upper(), r.url.path, dict(r.params))
        for r in server.requests
        if r.headers.get("User-Agent", "").startswith(agents)
    }
    return {p for p in seen if p is not None}


def granted(values: dict[str, Any]) -> set[Triple]:
    """Every triple the chart's operator ClusterRole and Roles grant."""
    docs = render(values)
    rules = [
        r
        for d in docs
        if d["kind"] in ("ClusterRole", "Role") and d["metadata"]["name"] == "kvf-operator"
        for r in d["rules"]
    ]
    return {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}


def stored(server: ApiServer, resource: str, name: str) -> dict[str, Any]:
    return server.stored(resource, "default", name) or {}


def valid(server: ApiServer) -> bool:
    conds = (stored(server, "kvfleet.dev/v1alpha1/tenantquotas", "acme").get("status") or {}).get(
        "conditions", []
    )
    return any(c["type"] == "Valid" and c["status"] == "True" for c in conds)


async def lifecycle(server: ApiServer, user: User, client: Any) -> None:
    isvc, deploy = "kvfleet.dev/v1alpha1/inferenceservices", "apps/v1/deployments"
    await user.apply(inferenceservice(model={"name": "llama", "uri": "pvc://weights/llama"}))
    await eventually(lambda: stored(server, isvc, "llama").get("status"), what="a status")
    await user.create_pvc("weights")
    await eventually(
        lambda: stored(server, "policy/v1/poddisruptionbudgets", "llama"), timeout=20, what="children"
    )
    await roll_out(client, "llama", ready=1)
    await user.scale("llama", 2)
    await eventually(lambda: stored(server, deploy, "llama")["spec"]["replicas"] == 2, what="scaled")
    await user.apply(inferenceservice(model={"name": "llama-2", "uri": "pvc://weights/llama"}, replicas=2))
    annotations = lambda: stored(server, "v1/services", "llama")["metadata"]["annotations"]  # noqa: E731
    await eventually(lambda: annotations()["kvfleet.dev/served-model-name"] == "llama-2", what="re-rendered")
    await user.apply(tenantquota(models=["llama-2"]))
    await user.create_secret("acme-key", "api-key", "sk-acme")
    await eventually(lambda: valid(server), timeout=20, what="the TenantQuota Valid")
    await user.delete("inferenceservices", "llama")
    await eventually(lambda: not stored(server, isvc, "llama"), what="deleted")
    await settle(server, quiet=0.5)


@pytest.mark.parametrize(
    ("config", "values", "peering"),
    [
        (OperatorConfig(all_namespaces=True, priority=10), {}, ("kopf.dev/v1/clusterkopfpeerings", None)),
        (
            OperatorConfig(namespaces=("default",), priority=10),
            {"operator": {"watchNamespaces": ["default"]}},
            ("kopf.dev/v1/kopfpeerings", "default"),
        ),
    ],
    ids=["all-namespaces", "one-namespace"],
)
async def test_the_chart_grants_the_operator_exactly_what_it_uses(
    tmp_path: Path, config: OperatorConfig, values: dict[str, Any], peering: tuple[str, str | None]
) -> None:
    async with serve() as server:
        resource, namespace = peering
        server.objects[resource, namespace, config.peering_name] = {
            "metadata": {"name": config.peering_name, "namespace": namespace}
        }
        with kubeconfig_for(server, tmp_path) as client:
            async with running_operator(config):
                await lifecycle(server, User(client), client)
        used = operator_permissions(server)
    assert used == granted(values)
