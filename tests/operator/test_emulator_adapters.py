"""LoRA adapters on kopf's real runtime and the emulated API server: an InferenceService's adapters
reach its engine pods and its status, a missing adapter claim degrades until it appears, a
TenantQuota may name an adapter, and the CRD refuses duplicate adapter names."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.testing.apiserver import ApiServer
from kvfleet.operator.testing.cluster import inferenceservice, tenantquota
from kvfleet.operator.testing.harness import eventually, running_operator

ISVC = "kvfleet.dev/v1alpha1/inferenceservices"
TQ = "kvfleet.dev/v1alpha1/tenantquotas"
DEPLOY = "apps/v1/deployments"
CONFIG = OperatorConfig(namespaces=("default",), standalone=True, engine_image="kvfleet:test")
ADAPTERS = [{"name": "sql", "uri": "pvc://loras/sql"}, {"name": "chat", "uri": "hf://acme/chat-lora@v1"}]


def condition(server: ApiServer, resource: str, name: str, kind: str) -> tuple[str, str, str] | None:
    obj = server.stored(resource, "default", name) or {}
    for c in (obj.get("status") or {}).get("conditions", []):
        if c["type"] == kind:
            return c["status"], c["reason"], c["message"]
    return None


async def test_adapters_reach_the_engine_pods_and_the_status_once_their_claim_exists(env: Any) -> None:
    server, user = env
    await user.create_secret("acme-key", "api-key", "sk-acme")
    async with running_operator(CONFIG):
        await user.apply(inferenceservice(adapters=ADAPTERS, engine={"maxLoras": 2}))
        await user.apply(tenantquota(models=["llama-3-8b", "sql"]))
        await eventually(lambda: condition(server, ISVC, "llama", "Degraded"), what="Degraded")
        degraded = condition(server, ISVC, "llama", "Degraded")
        await user.create_pvc("loras")
        await eventually(lambda: server.stored(DEPLOY, "default", "llama"), timeout=20, what="the Deployment")
        await eventually(lambda: condition(server, TQ, "acme", "Valid"), what="Valid")
    assert degraded == (
        "True",
        "PVCNotFound",
        "spec.adapters[0].uri 'pvc://loras/sql': PersistentVolumeClaim 'loras' not found in 'default'",
    )
    pod = (server.stored(DEPLOY, "default", "llama") or {})["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--lora-modules") :] == [
        "--lora-modules", "sql=/adapters/adapters-pvc-0/sql", "chat=/adapters/hf/chat",
        "--max-loras", "2", "--max-lora-rank", "16",
    ]  # fmt: skip
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-adapter-0"]
    assert (server.stored(ISVC, "default", "llama") or {})["status"]["adapters"] == ["sql", "chat"]
    assert condition(server, TQ, "acme", "Valid") == ("True", "Validated", "tenant 'acme': llama-3-8b, sql")


async def test_the_crd_refuses_two_adapters_of_one_name_and_stores_nothing(env: Any) -> None:
    server, user = env
    twice = [{"name": "sql", "uri": "file:///a"}, {"name": "sql", "uri": "file:///b"}]
    with pytest.raises(ApiException) as err:
        await user.apply(inferenceservice(adapters=twice))
    assert err.value.status == 422
    assert ".spec.adapters: adapter names must be unique" in str(err.value.body)
    assert server.stored(ISVC, "default", "llama") is None
