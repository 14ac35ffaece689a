"""The reconcile benchmark's workload and its instruments, shared by both sides (bench.cluster).

Where it sits: :mod:`.reconcile_scale` (the real control plane) and :mod:`.emulated` (kmock) apply
the same objects with the same client (:class:`Api`, the official ``kubernetes`` client from a
kubeconfig) and run the same operator process (:func:`operator_process`).
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from kvfleet.operator.testing.cluster import manifest
from kvfleet.protocol import API_GROUP, API_VERSION

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# the taint kvfleet.cluster.local puts on kwok's fake GPU node
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def workload(isvcs: int, quotas: int, *, gpu_node_tolerations: bool) -> list[dict[str, Any]]:
    """``isvcs`` one-GPU InferenceServices and ``quotas`` TenantQuotas, each with its Secret."""
    objs: list[dict[str, Any]] = []
    for i in range(isvcs):
        spec: dict[str, Any] = {
            "model": {
                "name": f"llama-{i:03d}",
                "uri": "file:///models/llama-3-8b",
                "architecture": "llama-3-8b",
            },
            "resources": {"gpus": 1, "gpuType": "h100"},
        }
        if gpu_node_tolerations:
            spec["placement"] = {"tolerations": [KWOK_TOLERATION]}
        objs.append(manifest("InferenceService", f"svc-{i:03d}", spec))
    for i in range(quotas):
        name = f"tenant-{i:03d}"
        # data, not stringData: the emulated server stores a Secret as sent (no stringData merge)
        key = base64.b64encode(f"sk-{name}-0123456789".encode()).decode()
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"{name}-key"},
            "data": {"api-key": key},
        }
        quota = {
            "tenant": name,
            "apiKeySecretRef": {"name": f"{name}-key"},
            "limits": {"requestsPerMinute": 600},
        }
        objs += [secret, manifest("TenantQuota", name, quota)]
    return objs


class Api:
    """The few calls the benchmark makes, through the official client."""

    def __init__(self, kubeconfig: Path) -> None:
        self.client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.apps = kubernetes.client.AppsV1Api(self.client)

    def create(self, namespace: str, obj: dict[str, Any]) -> None:
        if obj["kind"] == "Secret":
            self.core.create_namespaced_secret(namespace, obj)
        else:
            plural = obj["kind"].lower() + "s"
            self.custom.create_namespaced_custom_object(API_GROUP, API_VERSION, namespace, plural, obj)

    def list(self, plural: str, namespace: str) -> list[dict[str, Any]]:
        found = self.custom.list_namespaced_custom_object(API_GROUP, API_VERSION, namespace, plural)
        return list(found["items"])

    def exists(self, kind: str, namespace: str, name: str) -> bool:
        assert kind == "deployments"
        try:
            self.apps.read_namespaced_deployment(name, namespace)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True


def apply_workload(api: Api, namespace: str, objs: list[dict[str, Any]]) -> None:
    for obj in objs:
        api.create(namespace, obj)


@contextlib.contextmanager
def operator_process(kubeconfig: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``kvfleet operator --all-namespaces --standalone`` as a user runs it, until the block ends."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    cmd = [sys.executable, "-m", "kvfleet.cli", "operator", "--all-namespaces", "--standalone"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(60)
