"""The process node's API client (issue #43): a thin, thread-safe ``httpx`` client over a kubeconfig.

Where it sits: :mod:`kvfleet.cluster.kubelet` makes one :class:`Api` from its ``--kubeconfig``
(read by the official ``kubernetes`` package, so client certificates, tokens and CA data are
understood as every client understands them) and shares it with the pod workers. Objects travel as
plain dicts; an error status raises :class:`ApiError`. :func:`pod_kubeconfig` writes the kubeconfig
a pod's processes get: the same server and CA, the pod's service-account token.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import yaml

log = logging.getLogger(__name__)
Obj = dict[str, Any]
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code}: {text[:300]}")
        self.code = code


class Api:
    """Calls to one API server, as the user of ``kubeconfig``."""

    def __init__(self, kubeconfig: str) -> None:
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        self.server: str = cfg.host.rstrip("/")
        self.ca_pem: bytes | None = Path(cfg.ssl_ca_cert).read_bytes() if cfg.ssl_ca_cert else None
        self.insecure = not cfg.verify_ssl
        context = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if cfg.cert_file and cfg.key_file:
            context.load_cert_chain(cfg.cert_file, cfg.key_file)
        headers = {"Accept": "application/json"}
        token = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
        if token:
            prefix = cfg.api_key_prefix.get("authorization", "")
            headers["Authorization"] = f"{prefix} {token}".strip()
        # trust_env off: the API server of a local control plane is never behind the machine's proxy
        self.http = httpx.Client(
            base_url=self.server, verify=context, headers=headers, timeout=30.0, trust_env=False
        )

    def close(self) -> None:
        self.http.close()

    def request(
        self, method: str, path: str, body: Obj | None = None, content_type: str | None = None, **params: Any
    ) -> Obj:
        headers = {"Content-Type": content_type or "application/json"} if body is not None else {}
        content = json.dumps(body).encode() if body is not None else None
        response = self.http.request(method, path, content=content, headers=headers, params=params or None)
        if response.status_code >= 400:
            raise ApiError(response.status_code, response.text)
        return response.json() if response.content else {}

    def get(self, path: str, **params: Any) -> Obj | None:
        """The object at ``path``, or None when there is none (404)."""
        try:
            return self.request("GET", path, **params)
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def create(self, path: str, body: Obj) -> Obj:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Obj, content_type: str = STRATEGIC) -> Obj:
        return self.request("PATCH", path, body, content_type)

    def delete(self, path: str, body: Obj | None = None) -> Obj:
        return self.request("DELETE", path, body)

    def watch(self, path: str, timeout_s: int = 240, **params: Any) -> Iterator[Obj]:
        """The events of a watch on ``path`` until the server ends it; an error status raises."""
        query = {**params, "watch": "true", "timeoutSeconds": str(timeout_s), "allowWatchBookmarks": "true"}
        timeout = httpx.Timeout(30.0, read=timeout_s + 30.0)
        with self.http.stream("GET", path, params=query, timeout=timeout) as response:
            if response.status_code >= 400:
                raise ApiError(response.status_code, response.read().decode(errors="replace"))
            for line in response.iter_lines():
                if line.strip():
                    yield json.loads(line)


def pod_kubeconfig(api: Api, token: str, namespace: str) -> str:
    """A kubeconfig for a pod's processes: ``api``'s server and CA, ``token``, ``namespace`` by default."""
    cluster: Obj = {"server": api.server}
    if api.insecure:
        cluster["insecure-skip-tls-verify"] = True
    elif api.ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(api.ca_pem).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cluster", "cluster": cluster}],
        "users": [{"name": "pod", "user": {"token": token}}],
        "contexts": [
            {"name": "pod", "context": {"cluster": "cluster", "user": "pod", "namespace": namespace}}
        ],
        "current-context": "pod",
    }
    return yaml.safe_dump(config, sort_keys=False)
