"""Specs that cannot run, on kopf's real runtime and the emulated API server: a condition and an
event, never a crash loop; refused specs never reach the operator; nothing accepted is lost."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.testing.apiserver import ApiServer
from kvfleet.operator.testing.cluster import inferenceservice, tenantquota
from kvfleet.operator.testing.harness import eventually, running_operator, settle

ISVC = "kvfleet.dev/v1alpha1/inferenceservices"
TQ = "kvfleet.dev/v1alpha1/tenantquotas"
DEPLOY = "apps/v1/deployments"
CONFIG = OperatorConfig(namespaces=("default",), standalone=True, engine_image="kvfleet:test")


def conditions(server: ApiServer, resource: str, name: str) -> dict[str, tuple[str, str, str]]:
    obj = server.stored(resource, "default", name) or {}
    return {
        c["type"]: (c["status"], c["reason"], c["message"])
        for c in (obj.get("status") or {}).get("conditions", [])
    }


def events(server: ApiServer) -> list[tuple[str, str]]:
    return [
        (e["reason"], e["type"])
        for (res, _, _), obj in server.objects.items()
        if res.plural == "events"
        for e in [obj]
    ]


async def test_weights_too_big_for_the_gpus_degrade_without_rollout_until_the_spec_fits(env: Any) -> None:
    server, user = env
    too_big = inferenceservice(
        model={"name": "llama-3-70b", "uri": "file:///w"}, resources={"gpus": 1, "gpuType": "l4"}
    )
    async with running_operator(CONFIG):
        await user.apply(too_big)
        await eventually(lambda: "CapacityFits" in conditions(server, ISVC, "llama"), what="the conditions")
        await settle(server)
        fits, degraded = (
            conditions(server, ISVC, "llama")["CapacityFits"],
            conditions(server, ISVC, "llama")["Degraded"],
        )
        assert server.stored(DEPLOY, "default", "llama") is None
        assert events(server) == [("InsufficientGPUMemory", "Warning")]
        retried = "kvfleet.dev/reconcile" in (server.stored(ISVC, "default", "llama") or {})["metadata"].get(
            "annotations", {}
        )
        await user.apply(
            inferenceservice(
                model={"name": "llama-3-70b", "uri": "file:///w"}, resources={"gpus": 4, "gpuType": "h100"}
            )
        )
        await eventually(
            lambda: server.stored(DEPLOY, "default", "llama"), what="the Deployment once it fits"
        )
        await eventually(lambda: conditions(server, ISVC, "llama")["CapacityFits"][0] == "True", what="fits")
    assert fits[:2] == ("False", "InsufficientGPUMemory") and "exceed the usable 23192823398 bytes" in fits[2]
    assert degraded[:2] == ("True", "InsufficientGPUMemory")
    assert not retried  # a permanent verdict: no retry loop
    capacity = (server.stored(ISVC, "default", "llama") or {})["status"]["capacity"]
    assert (capacity["gpuType"], capacity["numGpus"], capacity["kvBytesPerToken"]) == ("h100", 4, 327680)


async def test_an_unknown_gpu_type_degrades_and_names_the_field(env: Any) -> None:
    server, user = env
    async with running_operator(CONFIG):
        await user.apply(inferenceservice(resources={"gpus": 1, "gpuType": "x100"}))
        await eventually(lambda: "Degraded" in conditions(server, ISVC, "llama"), what="the conditions")
    status, reason, message = conditions(server, ISVC, "llama")["Degraded"]
    assert (status, reason) == ("True", "UnknownGPUType")
    assert message.startswith("spec.resources.gpuType 'x100': unknown GPU 'x100': known GPUs are h100")
    assert server.stored(DEPLOY, "default", "llama") is None


async def test_a_missing_pvc_degrades_and_is_retried_until_the_claim_appears(env: Any) -> None:
    server, user = env
    async with running_operator(CONFIG):
        await user.apply(inferenceservice(model={"name": "m", "uri": "pvc://weights/m"}))
        await eventually(lambda: "Degraded" in conditions(server, ISVC, "llama"), what="the conditions")
        degraded = conditions(server, ISVC, "llama")["Degraded"]
        await user.create_pvc("weights")
        await eventually(lambda: server.stored(DEPLOY, "default", "llama"), timeout=20, what="the Deployment")
        await eventually(lambda: conditions(server, ISVC, "llama")["Degraded"][0] == "False", what="healed")
    assert degraded == (
        "True",
        "PVCNotFound",
        "spec.model.uri 'pvc://weights/m': PersistentVolumeClaim 'weights' not found in 'default'",
    )


async def test_a_spec_the_crd_refuses_is_a_422_naming_the_rule_and_stores_nothing(env: Any) -> None:
    server, user = env
    bad = inferenceservice(autoscaling={"minReplicas": 4, "maxReplicas": 2})
    with pytest.raises(ApiException) as err:
        await user.apply(bad)
    assert err.value.status == 422
    assert ".spec.autoscaling: minReplicas must be <= maxReplicas" in str(err.value.body)
    assert server.stored(ISVC, "default", "llama") is None
    await user.apply(inferenceservice())
    with pytest.raises(ApiException):
        await user.apply(inferenceservice(engine={"gpuMemoryUtilization": 2.0}))
    assert (server.stored(ISVC, "default", "llama") or {})["spec"]["engine"]["gpuMemoryUtilization"] == 0.9


async def test_a_tenantquota_without_its_secret_is_invalid_until_the_secret_exists(env: Any) -> None:
    server, user = env
    async with running_operator(CONFIG):
        await user.apply(tenantquota())
        await eventually(lambda: "Valid" in conditions(server, TQ, "acme"), what="Valid")
        invalid = conditions(server, TQ, "acme")["Valid"]
        await user.create_secret("acme-key", "api-key", "sk-acme")
        await eventually(
            lambda: conditions(server, TQ, "acme")["Valid"][0] == "True", timeout=20, what="valid"
        )
    assert invalid == ("False", "SecretNotFound", "spec.apiKeySecretRef: Secret 'acme-key' not found")
    assert conditions(server, TQ, "acme")["Valid"] == ("True", "Validated", "tenant 'acme': all models")
    assert ("SecretNotFound", "Warning") in events(server)


async def test_a_tenantquota_naming_an_unserved_model_is_invalid(env: Any) -> None:
    server, user = env
    await user.create_secret("acme-key", "api-key", "sk-acme")
    async with running_operator(CONFIG):
        await user.apply(inferenceservice())
        await user.apply(tenantquota(models=["llama-3-8b", "gpt-5"]))
        await eventually(lambda: "Valid" in conditions(server, TQ, "acme"), what="Valid")
    assert conditions(server, TQ, "acme")["Valid"] == (
        "False",
        "UnknownModel",
        "spec.models: gpt-5 not served by any InferenceService here (served: llama-3-8b)",
    )
