"""The operator's only door to the API server: the official ``kubernetes`` client, as dicts.

Every call the handlers make is a method here, as a plain REST request (the RBAC test
in ``tests/charts`` checks the chart grants exactly what these and kopf send). Configuration is found as every client finds it: in-cluster, else
``KUBECONFIG`` / ``~/.kube/config`` (:mod:`kvfleet.kubeconfig`, as the router finds it). Conflicts, throttling and server
errors become :class:`kopf.TemporaryError`, so kopf retries the handler with backoff.
"""

from __future__ import annotations

import json
from typing import Any

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException

from kvfleet.protocol import API_GROUP, API_VERSION

from .renderers import Obj

RETRIED_STATUSES = frozenset({409, 429, 500, 502, 503, 504})


def backoff_seconds(retry: int) -> float:
    """Delay before kopf's ``retry``-th retry: doubling from 1 s, capped at 60 s."""
    return float(min(60, 2 ** min(retry, 6)))


USER_AGENT = "kvfleet-operator/0.1.0"


def api_client(cfg: kubernetes.client.Configuration) -> kubernetes.client.ApiClient:
    """The operator's client; it names itself so audit logs (and the RBAC test) can tell it apart."""
    client = kubernetes.client.ApiClient(cfg)
    client.user_agent = USER_AGENT
    return client


def connection_info(cfg: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """kopf's own connection, from the same configuration the operator's client uses."""
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


# The REST paths of the kinds the operator owns, by kind: (API prefix, plural).
CHILD_PATHS = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
}
CUSTOM_PREFIX = f"/apis/{API_GROUP}/{API_VERSION}"
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class ApiError(Exception):
    """An API answer the operator cannot act on (4xx other than 404/409/429): kopf retries the handler."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: {status} {message}")
        self.status = status


def _path(prefix: str, namespace: str, plural: str, name: str | None = None, sub: str | None = None) -> str:
    return "/".join(p for p in (prefix, "namespaces", namespace, plural, name, sub) if p)


class KubeApi:
    """The REST calls of the operator as dicts, through the official client's transport and auth.

    The typed API classes validate every body against pydantic models built on first use
    (seconds per kind on a small machine); the operator only needs JSON in and out."""

    def __init__(self, client: kubernetes.client.ApiClient, retry: int = 0) -> None:
        self.client = client
        self.retry = retry

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        missing_ok: bool = False,
    ) -> Obj | None:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        _, url, headers, payload, _ = self.client.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            resp = self.client.call_api(method, url, headers, payload)
        except ApiException as exc:  # transport-level failures the client reports this way
            raise kopf.TemporaryError(
                f"{method} {path}: {exc.reason}", delay=backoff_seconds(self.retry)
            ) from exc
        data = resp.read()
        if resp.status == 404 and missing_ok:
            return None
        if resp.status in RETRIED_STATUSES:
            raise kopf.TemporaryError(
                f"{method} {path}: {resp.status} {resp.reason}; retrying", delay=backoff_seconds(self.retry)
            )
        if resp.status >= 400:
            raise ApiError(resp.status, method, path, data.decode(errors="replace")[:300] if data else "")
        return json.loads(data) if data else {}

    def _must(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Obj:
        out = self.request(method, path, body, content_type)
        assert out is not None  # only missing_ok requests return None
        return out

    # children (children.ChildApi)
    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        prefix, plural = CHILD_PATHS[kind]
        return self.request("GET", _path(prefix, namespace, plural, name), missing_ok=True)

    def create(self, obj: Obj) -> Obj:
        prefix, plural = CHILD_PATHS[obj["kind"]]
        return self._must("POST", _path(prefix, obj["metadata"]["namespace"], plural), obj)

    def patch(self, kind: str, namespace: str, name: str, ops: list[Obj]) -> Obj:
        prefix, plural = CHILD_PATHS[kind]
        return self._must("PATCH", _path(prefix, namespace, plural, name), ops, JSON_PATCH)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        prefix, plural = CHILD_PATHS[kind]
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        self.request("DELETE", _path(prefix, namespace, plural, name), body, missing_ok=True)

    # the operator's own resources
    def get_custom(self, plural: str, namespace: str, name: str) -> Obj | None:
        return self.request("GET", _path(CUSTOM_PREFIX, namespace, plural, name), missing_ok=True)

    def list_custom(self, plural: str, namespace: str) -> list[Obj]:
        return list(self._must("GET", _path(CUSTOM_PREFIX, namespace, plural)).get("items", []))

    def patch_status(self, plural: str, namespace: str, name: str, status: Obj) -> None:
        path = _path(CUSTOM_PREFIX, namespace, plural, name, "status")
        self.request("PATCH", path, {"status": status}, MERGE_PATCH, missing_ok=True)

    # what specs refer to
    def pvc_exists(self, namespace: str, name: str) -> bool:
        return (
            self.request("GET", _path("/api/v1", namespace, "persistentvolumeclaims", name), missing_ok=True)
            is not None
        )

    def get_secret(self, namespace: str, name: str) -> Obj | None:
        return self.request("GET", _path("/api/v1", namespace, "secrets", name), missing_ok=True)
