"""``--kubernetes`` mode: the cluster as discovery, tenant source and scaler (docs/architecture.md §6, §7).

The API server is found as the operator finds it (:mod:`kvfleet.kubeconfig`: in-cluster
config, else ``KUBECONFIG`` / ``~/.kube/config``); the calls
themselves go through ``httpx`` so they are asynchronous. A :class:`Reflector` per
resource lists, then watches, and re-lists when the watch ends, keeping a local copy:

* InferenceServices → :class:`Service` (``spec.model.name``, ``spec.routing.policy`` and
  ``sharedPrefixCache``, ``spec.slo``, ``spec.autoscaling``, ``spec.engine.kind``);
* engine pods (labels ``app.kubernetes.io/name=kvfleet-engine`` and
  ``kvfleet.dev/inferenceservice``), ready and not terminating → endpoints
  ``http://<podIP>:<port named http>``, of the kind their ``kvfleet.dev/engine-kind`` label
  names (else their InferenceService's; vLLM pods too carry the engine labels);
* TenantQuotas and their Secrets (``spec.apiKeySecretRef``) → the tenant table,
  replaced whole on every change.

:class:`KubernetesScaler` reads and writes the InferenceService ``/scale`` subresource.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import ValidationError

from kvfleet.protocol import (
    API_GROUP,
    API_VERSION,
    DEFAULT_ENGINE_PORT,
    ENGINE_KINDS,
    INFERENCESERVICE_PLURAL,
    LABEL_APP,
    LABEL_APP_ENGINE,
    LABEL_ENGINE_KIND,
    LABEL_INFERENCESERVICE,
    TENANTQUOTA_PLURAL,
)
from kvfleet.resources import AutoscalingSpec, SLOSpec, TenantSpec
from kvfleet.router.config import RouterConfig
from kvfleet.router.discovery import Endpoint, FleetView, Service
from kvfleet.router.picker import POLICIES
from kvfleet.router.tenants import TenantRegistry

log = logging.getLogger(__name__)
Key = tuple[str, str]


def api_client_settings() -> tuple[str, dict[str, Any]]:
    """The API server's URL and httpx settings, from in-cluster config or the kubeconfig."""
    from kvfleet.kubeconfig import client_configuration

    cfg = client_configuration()
    headers: dict[str, str] = {}
    token = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
    if token:
        prefix = cfg.api_key_prefix.get("authorization", "")
        headers["Authorization"] = f"{prefix} {token}".strip()
    verify: Any = cfg.ssl_ca_cert if cfg.verify_ssl and cfg.ssl_ca_cert else cfg.verify_ssl
    settings: dict[str, Any] = {"headers": headers, "verify": verify}
    if cfg.cert_file and cfg.key_file:
        settings["cert"] = (cfg.cert_file, cfg.key_file)
    return cfg.host.rstrip("/"), settings


def _path(group: str, plural: str, namespace: str | None) -> str:
    base = "/api/v1" if group == "" else f"/apis/{group}/{API_VERSION}"
    return f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"


def _key(obj: dict[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "default", meta.get("name") or "")


@dataclass
class Reflector:
    """A local copy of one resource's objects, kept by list + watch."""

    http: httpx.AsyncClient
    path: str
    on_change: Callable[[], None]
    selector: str | None = None
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    listed: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        # Invariant: after each list, ``objects`` equals the server's set; every watch event after
        # it is applied in order, so the copy only lags the server, never diverges from it.
        while True:
            try:
                selector = {"labelSelector": self.selector} if self.selector else {}
                listing = (await self.http.get(self.path, params=selector)).raise_for_status().json()
                self.objects = {_key(o): o for o in listing.get("items") or []}
                self.listed.set()
                self.on_change()
                await self._watch()
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("watch of %s failed (%s); re-listing", self.path, type(exc).__name__)
            await asyncio.sleep(1.0)

    async def _watch(self) -> None:
        params = {"watch": "true", "timeoutSeconds": "300"}
        if self.selector:
            params["labelSelector"] = self.selector
        async with self.http.stream("GET", self.path, params=params, timeout=None) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") in ("ADDED", "MODIFIED"):
                    self.objects[_key(obj)] = obj
                elif event.get("type") == "DELETED":
                    self.objects.pop(_key(obj), None)
                else:
                    continue
                self.on_change()


def service_of(obj: dict[str, Any]) -> Service | None:
    namespace, name = _key(obj)
    spec = obj.get("spec") or {}
    model = (spec.get("model") or {}).get("name") or name
    try:
        auto = AutoscalingSpec.model_validate(spec["autoscaling"]) if spec.get("autoscaling") else None
        slo = SLOSpec.model_validate(spec.get("slo") or {})
    except ValidationError as exc:
        log.warning("InferenceService %s/%s ignored: %s", namespace, name, exc.errors()[0]["msg"])
        return None
    routing = spec.get("routing") or {}
    policy = routing.get("policy")
    if policy is not None and policy not in POLICIES:
        log.warning(
            "InferenceService %s/%s: unknown routing policy %r, using the default", namespace, name, policy
        )
        policy = None
    shared = routing.get("sharedPrefixCache")
    kind = (spec.get("engine") or {}).get("kind")
    if kind is not None and kind not in ENGINE_KINDS:
        log.warning("InferenceService %s/%s ignored: unknown spec.engine.kind %r", namespace, name, kind)
        return None
    return Service(
        name=name,
        model=model,
        namespace=namespace,
        policy=policy,
        slo=slo,
        autoscaling=auto,
        shared_prefix_cache=shared if isinstance(shared, bool) else None,
        engine_kind=kind,
        replicas=spec["replicas"] if isinstance(spec.get("replicas"), int) else None,
    )


def endpoint_of(pod: dict[str, Any]) -> Endpoint | None:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    if labels.get(LABEL_APP) != LABEL_APP_ENGINE or not labels.get(LABEL_INFERENCESERVICE):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    if meta.get("deletionTimestamp") or not ready or not status.get("podIP"):
        return None
    kind = labels.get(LABEL_ENGINE_KIND)
    if kind is not None and kind not in ENGINE_KINDS:
        log.warning("pod %s ignored: unknown label %s=%r", meta.get("name"), LABEL_ENGINE_KIND, kind)
        return None
    port = DEFAULT_ENGINE_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http":
                port = int(p["containerPort"])
    namespace = meta.get("namespace") or "default"
    return Endpoint(
        f"http://{status['podIP']}:{port}",
        service=f"{namespace}/{labels[LABEL_INFERENCESERVICE]}",
        kind=kind,
    )


def tenants_of(
    quotas: dict[Key, dict[str, Any]], secrets: dict[Key, dict[str, Any]]
) -> list[tuple[str, TenantSpec]]:
    entries: list[tuple[str, TenantSpec]] = []
    for (namespace, name), obj in sorted(quotas.items()):
        spec = obj.get("spec") or {}
        ref = spec.get("apiKeySecretRef") or {}
        data = (secrets.get((namespace, ref.get("name", ""))) or {}).get("data") or {}
        raw = data.get(ref.get("key", ""))
        try:
            tenant = TenantSpec.model_validate(spec)
            key = base64.b64decode(raw).decode().strip() if raw else ""
        except (ValidationError, ValueError) as exc:
            log.warning("TenantQuota %s/%s ignored: %s", namespace, name, type(exc).__name__)
            continue
        if not key:
            log.warning("TenantQuota %s/%s ignored: its Secret or key is missing", namespace, name)
            continue
        entries.append((key, tenant))
    return entries


class KubernetesDiscovery:
    def __init__(self, services: Reflector, pods: Reflector) -> None:
        self.services, self.pods = services, pods

    async def view(self) -> FleetView:
        svcs = tuple(s for o in self.services.objects.values() if (s := service_of(o)) is not None)
        eps = tuple(e for p in self.pods.objects.values() if (e := endpoint_of(p)) is not None)
        return FleetView(endpoints=eps, services=svcs)

    async def close(self) -> None:
        return None


@dataclass
class KubernetesScaler:
    """Replicas through the InferenceService ``/scale`` subresource."""

    http: httpx.AsyncClient

    def _scale(self, service: Service) -> str:
        return f"{_path(API_GROUP, INFERENCESERVICE_PLURAL, service.namespace)}/{service.name}/scale"

    async def current_replicas(self, service: Service) -> int:
        scale = (await self.http.get(self._scale(service))).raise_for_status().json()
        # autoscaling/v1 Scale omits spec.replicas when it is 0 (omitempty): a real API server sends {}
        return int((scale.get("spec") or {}).get("replicas", 0))

    async def set_replicas(self, service: Service, replicas: int) -> None:
        body = json.dumps({"spec": {"replicas": replicas}})
        headers = {"Content-Type": "application/merge-patch+json"}
        (await self.http.patch(self._scale(service), content=body, headers=headers)).raise_for_status()


@dataclass
class Cluster:
    discovery: KubernetesDiscovery
    scaler: KubernetesScaler


@contextlib.asynccontextmanager
async def cluster(config: RouterConfig, tenants: TenantRegistry) -> AsyncIterator[Cluster]:
    """Start the watches; yield once every resource has been listed; stop them on exit."""
    host, settings = api_client_settings()
    ns = config.namespace
    async with httpx.AsyncClient(base_url=host, timeout=10.0, **settings) as http:
        quotas: Reflector
        secrets: Reflector

        def refresh_tenants() -> None:
            tenants.replace(tenants_of(quotas.objects, secrets.objects))

        services = Reflector(http, _path(API_GROUP, INFERENCESERVICE_PLURAL, ns), lambda: None)
        pods = Reflector(
            http, _path("", "pods", ns), lambda: None, selector=f"{LABEL_APP}={LABEL_APP_ENGINE}"
        )
        quotas = Reflector(http, _path(API_GROUP, TENANTQUOTA_PLURAL, ns), refresh_tenants)
        secrets = Reflector(http, _path("", "secrets", ns), refresh_tenants)
        reflectors = [services, pods, quotas, secrets]
        tasks = [asyncio.create_task(r.run()) for r in reflectors]
        try:
            await asyncio.wait_for(asyncio.gather(*(r.listed.wait() for r in reflectors)), 30.0)
            yield Cluster(KubernetesDiscovery(services, pods), KubernetesScaler(http))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
