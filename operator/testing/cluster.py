"""What a user and the cluster's own controllers do, for tests of the operator on the emulator.

The user side (:class:`User`) is the official ``kubernetes`` client, called the way
``kubectl apply`` / ``kubectl scale`` / ``kubectl delete`` call the API; the cluster side
(:func:`roll_out`) is what the Deployment controller would write to a Deployment's status.
Every call runs in a thread so the event loop serving the emulator never blocks.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from kvfleet.operator.kube import KubeApi
from kvfleet.protocol import API_GROUP, API_VERSION, INFERENCESERVICE_PLURAL, TENANTQUOTA_PLURAL

NAMESPACE = "default"


def manifest(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A kvfleet resource as a user writes one (no defaults filled in)."""
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": kind,
        "metadata": {"name": name},
        "spec": spec,
    }


def inferenceservice(name: str = "llama", **spec: Any) -> dict[str, Any]:
    model = {"model": {"name": "llama-3-8b", "uri": "file:///models/llama-3-8b"}}
    return manifest("InferenceService", name, model | spec)


def tenantquota(name: str = "acme", **spec: Any) -> dict[str, Any]:
    key = {"tenant": name, "apiKeySecretRef": {"name": f"{name}-key"}}
    return manifest("TenantQuota", name, key | spec)


class User:
    """``kubectl`` on the emulator, through the official client."""

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.core = kubernetes.client.CoreV1Api(client)

    async def apply(self, obj: dict[str, Any]) -> None:
        """Create, or merge-patch what the manifest says (``kubectl apply``)."""
        plural = INFERENCESERVICE_PLURAL if obj["kind"] == "InferenceService" else TENANTQUOTA_PLURAL
        args = (API_GROUP, API_VERSION, NAMESPACE, plural)
        try:
            await asyncio.to_thread(self.custom.create_namespaced_custom_object, *args, obj)
        except ApiException as exc:
            if exc.status != 409:
                raise
            name = obj["metadata"]["name"]
            await asyncio.to_thread(
                self.custom.patch_namespaced_custom_object, *args, name, {"spec": obj["spec"]}
            )

    async def scale(self, name: str, replicas: int) -> None:
        """``kubectl scale`` (and the router's autoscaler): the scale subresource."""
        args = (API_GROUP, API_VERSION, NAMESPACE, INFERENCESERVICE_PLURAL, name)
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_scale, *args, {"spec": {"replicas": replicas}}
        )

    async def delete(self, plural: str, name: str) -> None:
        args = (API_GROUP, API_VERSION, NAMESPACE, plural, name)
        await asyncio.to_thread(self.custom.delete_namespaced_custom_object, *args)

    async def create_secret(self, name: str, key: str, value: str) -> None:
        data = {key: base64.b64encode(value.encode()).decode()}
        body: Any = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": data}
        await asyncio.to_thread(self.core.create_namespaced_secret, NAMESPACE, body)

    async def create_pvc(self, name: str) -> None:
        spec = {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "20Gi"}}}
        body: Any = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": spec,
        }
        await asyncio.to_thread(self.core.create_namespaced_persistent_volume_claim, NAMESPACE, body)


async def roll_out(client: kubernetes.client.ApiClient, name: str, ready: int) -> None:
    """What the Deployment controller reports once ``ready`` pods of the current template are ready."""
    api = KubeApi(client)
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}"
    dep = await asyncio.to_thread(api.request, "GET", path)
    assert dep is not None
    status = {
        "observedGeneration": dep["metadata"].get("generation", 1),
        "replicas": ready,
        "updatedReplicas": ready,
        "readyReplicas": ready,
        "availableReplicas": ready,
    }
    await asyncio.to_thread(
        api.request, "PATCH", path + "/status", {"status": status}, "application/merge-patch+json"
    )
