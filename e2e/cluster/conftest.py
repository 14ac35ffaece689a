"""kvfleet on a real Kubernetes control plane (issue #43): one local cluster for this folder.

The fixture runs what ``make cluster-up`` runs (:func:`kvfleet.cluster.local.up`): etcd,
kube-apiserver with RBAC, kube-controller-manager, kube-scheduler, the process node whose pods
are local processes, kwok's fake GPU node; then, as a user would, ``kubectl apply --server-side -f
crds/`` and ``helm install`` of ``charts/kvfleet``. The binaries are built from their Go modules
once per machine (cached by version, docs/cluster.md).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvfleet.cluster import binaries, local
from kvfleet.cluster.audit import AuditLog, service_account

T = TypeVar("T")
OPERATOR_SA = service_account(local.NAMESPACE, "kvfleet-operator")
ROUTER_SA = service_account(local.NAMESPACE, "kvfleet-router")
HELM_VALUES = ("--set", "router.usageLog=-")


# a fresh machine's cold build of the binaries (~19 minutes on 2 cores) may still be running when this
# folder's first test starts: that test waits for it beyond the suite's per-test timeout
BUILD_WAIT_S = 2700


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    first = next((item for item in items if here in item.path.parents), None)
    if first is not None and binaries.built() is None:
        first.add_marker(pytest.mark.timeout(BUILD_WAIT_S))


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local.Cluster]:
    if shutil.which("go") is None and binaries.built() is None:
        pytest.skip("Go (>= 1.26) is needed to build the control plane's binaries: docs/cluster.md")
    state = tmp_path_factory.mktemp("cluster")
    running = local.up(state, models=("tiny", "smollm2"), install=False)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="package")
def installed(cluster: local.Cluster) -> local.Cluster:
    """The cluster with kvfleet installed by ``kubectl apply --server-side -f crds/`` and ``helm install``."""
    local.install_kvfleet(cluster, HELM_VALUES)
    return cluster


@pytest.fixture(scope="package")
def audit(cluster: local.Cluster) -> AuditLog:
    return AuditLog(cluster.cp.audit_log)


def eventually(probe: Callable[[], T | None], timeout: float, what: str, pause: float = 0.5) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` at ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(pause)
    raise AssertionError(f"{what}: not after {timeout:.0f} s (last: {last!r})")


def get(cluster: local.Cluster, *args: str) -> Any:
    """``kubectl get … -o json`` parsed; None when the object does not exist."""
    out = cluster.kubectl("get", *args, "-o", "json", "--ignore-not-found")
    return json.loads(out) if out.strip() else None


def items(cluster: local.Cluster, *args: str) -> list[Any]:
    """The objects a list query finds (kubectl prints nothing for none with --ignore-not-found)."""
    found = get(cluster, *args)
    return list(found["items"]) if found else []


def apply(cluster: local.Cluster, manifest: dict[str, Any] | Path, *extra: str) -> str:
    if isinstance(manifest, Path):
        return cluster.kubectl("apply", "-f", str(manifest), *extra)
    return cluster.kubectl("apply", "-f", "-", *extra, stdin=json.dumps(manifest))


def condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return str(c.get("status"))
    return None


def ready_pod_ips(cluster: local.Cluster, namespace: str, selector: str) -> list[str]:
    return sorted(
        p["status"]["podIP"]
        for p in items(cluster, "pods", "-n", namespace, "-l", selector)
        if condition(p, "Ready") == "True" and not p["metadata"].get("deletionTimestamp")
    )


def router_url(cluster: local.Cluster) -> str:
    ips = eventually(
        lambda: ready_pod_ips(cluster, local.NAMESPACE, "app.kubernetes.io/name=kvfleet-router"),
        120,
        "router Ready",
    )
    return f"http://{ips[0]}:8080"


TINY = local.REPO / "examples" / "inferenceservice-tiny-cpu.yaml"
KEY = "sk-e2e-cluster"


def tenant(name: str, key: str, **limits: int) -> list[dict[str, Any]]:
    secret = {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-key", "namespace": "default"},
        "stringData": {"api-key": key},
    }  # fmt: skip
    quota = {
        "apiVersion": "kvfleet.dev/v1alpha1", "kind": "TenantQuota", "metadata": {"name": name, "namespace": "default"},
        "spec": {"tenant": name, "apiKeySecretRef": {"name": f"{name}-key"}, "limits": limits},
    }  # fmt: skip
    return [secret, quota]


@pytest.fixture(scope="package")
def tiny(installed: local.Cluster) -> local.Cluster:
    """The README's example applied unchanged, Ready; a tenant with a generous quota."""
    for obj in tenant("e2e", KEY, requestsPerMinute=6000):
        installed.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    installed.kubectl("apply", "-f", str(TINY))
    eventually(
        lambda: condition(get(installed, "inferenceservice", "tiny", "-n", "default"), "Ready") == "True",
        300,
        "InferenceService tiny Ready",
        pause=1,
    )
    return installed
