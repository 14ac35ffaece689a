"""``--kubernetes`` mode against kmock's KubernetesEmulator: services, pods, tenants watched live, /scale."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvfleet.router.app import build_app
from kvfleet.router.config import RouterConfig
from kvfleet.router.discovery import Service
from kvfleet.router.kube import KubernetesScaler
from kvfleet.testing.processes import free_port

from .fakes import FakeEngine, served

NS = "team"
ISVC = f"/apis/kvfleet.dev/v1alpha1/namespaces/{NS}/inferenceservices"
TQ = f"/apis/kvfleet.dev/v1alpha1/namespaces/{NS}/tenantquotas"
PODS = f"/api/v1/namespaces/{NS}/pods"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"


@pytest.fixture
def kubeconfig(kmock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for res in [
        "kvfleet.dev/v1alpha1/inferenceservices",
        "kvfleet.dev/v1alpha1/tenantquotas",
        "v1/pods",
        "v1/secrets",
    ]:
        kmock.resources[res] = {"namespaced": True}
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
                "users": [{"name": "router", "user": {"token": "router-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "kmock", "user": "router"}}],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


def isvc(name: str, replicas: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"name": "tiny"}, "replicas": replicas, **spec},
    }


def pod(name: str, service: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app.kubernetes.io/name": "kvfleet-engine", "kvfleet.dev/inferenceservice": service},
        },
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def secret(name: str, key: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": NS},
        "data": {"apiKey": base64.b64encode(key.encode()).decode()},
    }


def quota(tenant: str, secret_name: str, **limits: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "TenantQuota",
        "metadata": {"name": tenant, "namespace": NS},
        "spec": {
            "tenant": tenant,
            "apiKeySecretRef": {"name": secret_name, "key": "apiKey"},
            "models": ["tiny"],
            "limits": limits,
            "priority": 0,
            "weight": 1,
        },
    }


async def alice_and(kmock: Any, service: dict[str, Any]) -> None:
    """The cluster holds ``service`` and tenant alice: her key in a Secret, a TenantQuota naming it."""
    async with httpx.AsyncClient(base_url=str(kmock.url).rstrip("/")) as api:
        (await api.post(ISVC, json=service)).raise_for_status()
        (await api.post(SECRETS, json=secret("alice-key", "sk-alice-0123456789"))).raise_for_status()
        (await api.post(TQ, json=quota("alice", "alice-key"))).raise_for_status()


async def alice_asks(http: httpx.AsyncClient) -> httpx.Response:
    """Alice's completion request for model tiny, through the router ``http`` points at."""
    return await http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "x"},
        headers={"Authorization": "Bearer sk-alice-0123456789"},
    )


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


@contextlib.asynccontextmanager
async def kube_router(kmock: Any) -> AsyncIterator[tuple[str, Any, httpx.AsyncClient]]:
    async with httpx.AsyncClient(base_url=str(kmock.url).rstrip("/")) as api:
        config = RouterConfig(
            kubernetes=True, namespace=NS, load_interval_s=0.05, load_stale_s=5.0, autoscale_interval_s=0.2
        )
        app = build_app(config)
        async with served(app, free_port()) as url:
            yield url, app.state.router, api


async def test_services_pods_and_tenants_come_from_the_cluster_and_follow_its_changes(
    kmock, kubeconfig
) -> None:
    engine = FakeEngine()
    async with served(engine.app(), free_port()) as engine_url:
        port = int(engine_url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(base_url=str(kmock.url).rstrip("/")) as api:
            (
                await api.post(
                    ISVC,
                    json=isvc("chat", 1, routing={"policy": "kv-aware"}, slo={"ttftMs": 500, "tpotMs": 50}),
                )
            ).raise_for_status()
            (await api.post(PODS, json=pod("chat-0", "chat", port))).raise_for_status()
            (await api.post(SECRETS, json=secret("alice-key", "sk-alice-0123456789"))).raise_for_status()
            (await api.post(TQ, json=quota("alice", "alice-key", requestsPerMinute=100))).raise_for_status()
        async with kube_router(kmock) as (url, state, api):
            await until(lambda: bool(state.fleet.ready_engines("tiny")), "the pod's engine is ready")
            service = state.fleet.service_for("tiny")
            assert (service.key, service.policy, service.slo.ttft_ms) == ("team/chat", "kv-aware", 500.0)
            assert list(state.fleet.engines) == [engine_url]
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                body = {"model": "tiny", "prompt": "x"}
                ok = await http.post(
                    "/v1/completions", json=body, headers={"Authorization": "Bearer sk-alice-0123456789"}
                )
                assert ok.status_code == 200
                # rotate the key in the Secret: the old one stops working, the new one works
                new = {"data": {"apiKey": base64.b64encode(b"sk-alice-rotated-999").decode()}}
                (
                    await api.patch(
                        f"{SECRETS}/alice-key",
                        json=new,
                        headers={"Content-Type": "application/merge-patch+json"},
                    )
                ).raise_for_status()
                await until(
                    lambda: state.tenants.authenticate("sk-alice-rotated-999") is not None, "key rotated"
                )
                old = await http.post(
                    "/v1/completions", json=body, headers={"Authorization": "Bearer sk-alice-0123456789"}
                )
                assert old.status_code == 401
                (await api.delete(f"{TQ}/alice")).raise_for_status()
                await until(lambda: state.tenants.names() == [], "tenant removed")
            (await api.delete(f"{PODS}/chat-0")).raise_for_status()
            await until(lambda: not state.fleet.engines, "the deleted pod's engine is gone")
    router_calls = [r for r in list(kmock) if r.method == "GET" and r.resource]  # the test itself only writes
    assert router_calls and all(r.headers.get("Authorization") == "Bearer router-token" for r in router_calls)


async def test_scale_from_zero_holds_the_request_until_an_engine_is_ready(kmock, kubeconfig) -> None:
    engine = FakeEngine()
    auto = {"minReplicas": 0, "maxReplicas": 3, "scaleToZero": True, "targetQueueDepth": 4}
    async with served(engine.app(), free_port()) as engine_url:
        port = int(engine_url.rsplit(":", 1)[1])
        await alice_and(kmock, isvc("chat", 0, autoscaling=auto))
        async with kube_router(kmock) as (url, state, api):
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                held = asyncio.create_task(alice_asks(http))

                def replicas() -> int:
                    return int(
                        kmock.objects["kvfleet.dev/v1alpha1/inferenceservices", NS, "chat"]["spec"][
                            "replicas"
                        ]
                    )

                await until(lambda: replicas() == 1, "the autoscaler wrote /scale")
                assert not held.done()
                # the operator's part: a pod comes up for the new replica
                (await api.post(PODS, json=pod("chat-0", "chat", port))).raise_for_status()
                response = await held
            assert response.status_code == 200
            scale_writes = [r for r in list(kmock) if r.subresource == "scale" and r.method == "PATCH"]
            assert [r.data for r in scale_writes] == [{"spec": {"replicas": 1}}]


async def test_a_rollouts_gap_holds_the_request_until_the_new_engine_is_ready(kmock, kubeconfig) -> None:
    """No autoscaling, replicas 1, and for a moment no ready pod (the old one deleting, the new one
    not yet seen ready): the request waits for the new engine instead of a 503."""
    engine = FakeEngine()
    async with served(engine.app(), free_port()) as engine_url:
        port = int(engine_url.rsplit(":", 1)[1])
        await alice_and(kmock, isvc("chat", 1))
        async with kube_router(kmock) as (url, state, api):
            await until(lambda: state.fleet.service_for("tiny") is not None, "the service seen")
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                held = asyncio.create_task(alice_asks(http))
                await until(lambda: state.waiting("tiny") == 1, "the request queued")
                assert not held.done()
                (await api.post(PODS, json=pod("chat-1", "chat", port))).raise_for_status()
                response = await held
            assert response.status_code == 200


async def test_a_model_whose_service_wants_no_replica_is_refused_at_once(kmock, kubeconfig) -> None:
    await alice_and(kmock, isvc("chat", 0))
    async with kube_router(kmock) as (url, state, _):
        await until(lambda: state.fleet.service_for("tiny") is not None, "the service seen")
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            refused = await alice_asks(http)
    assert refused.status_code in (404, 503), refused.text


@pytest.mark.parametrize(("spec", "replicas"), [({}, 0), ({"replicas": 0}, 0), ({"replicas": 3}, 3)])
async def test_the_scale_subresource_without_replicas_means_zero(spec: dict[str, Any], replicas: int) -> None:
    """A real API server omits spec.replicas of an autoscaling/v1 Scale at 0 (omitempty): read as 1,
    the autoscaler never scaled a service back from zero (found on the real control plane)."""

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path.endswith("/inferenceservices/chat/scale")
        return httpx.Response(200, json={"kind": "Scale", "apiVersion": "autoscaling/v1", "spec": spec})

    async with httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(answer)) as http:
        assert await KubernetesScaler(http).current_replicas(Service(name="chat", model="tiny")) == replicas
