"""50 InferenceServices + 200 TenantQuotas reconciled by `kvfleet operator`, on the real control plane
and on the emulated API server, in one run (issue #43).

The same operator process on both sides (``kvfleet operator --all-namespaces --standalone``, found
through KUBECONFIG); the same objects applied in a burst by the same client (the official
``kubernetes`` client). Printed per side, over ``--runs`` runs (median and spread):

- converge: from the first apply (the burst's 450 creates, sent one after another, included and
  printed apart) until every InferenceService has its Deployment and its status
  (observedGeneration) and every TenantQuota its Valid condition;
- operator API writes per object (POST/PUT/PATCH/DELETE): on the real server from its audit log
  (the operator authenticates as the chart's ``kvfleet-operator`` service account, with the
  chart's RBAC), on the emulator from kmock's request log;
- operator CPU seconds for the whole burst, from /proc of the operator process.

On the real control plane the engine pods land on kwok's fake GPU node (placement tolerates its
taint) and are run by kwok's stages, so the figure is the control plane's and the operator's, not
the engines'. Run: ``timeout 1800 .venv/bin/python -m bench.cluster.reconcile_scale [--runs 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfleet.cluster import local
from kvfleet.cluster.audit import AuditLog, service_account, writes

from .workload import Api, apply_workload, cpu_seconds, operator_process, workload

OPERATOR_SA = service_account(local.NAMESPACE, "kvfleet-operator")


@dataclass
class Run:
    converge_s: float
    apply_s: float
    writes_per_object: float
    cpu_s: float


def wait_converged(
    api: Api, namespace: str, isvcs: int, quotas: int, start: float, timeout: float = 900
) -> float:
    """Seconds from ``start`` (monotonic: the first apply) until every InferenceService is reconciled
    and every TenantQuota judged."""
    while time.monotonic() - start < timeout:
        done_isvc = sum(
            1
            for o in api.list("inferenceservices", namespace)
            if (o.get("status") or {}).get("observedGeneration") == o["metadata"].get("generation")
            and api.exists("deployments", namespace, o["metadata"]["name"])
        )
        done_tq = sum(
            1
            for o in api.list("tenantquotas", namespace)
            if any(c["type"] == "Valid" for c in (o.get("status") or {}).get("conditions", []))
        )
        if done_isvc == isvcs and done_tq == quotas:
            return time.monotonic() - start
        time.sleep(0.5)
    raise TimeoutError(f"not converged in {timeout} s")


def real_run(cluster: local.Cluster, kubeconfig: Path, n: int, isvcs: int, quotas: int) -> Run:
    namespace = f"bench-{n}"
    cluster.kubectl("create", "namespace", namespace)
    audit = AuditLog(cluster.cp.audit_log)
    with operator_process(kubeconfig) as proc:
        api = Api(cluster.kubeconfig)
        time.sleep(5)  # the operator's watches established
        start_offset, cpu0 = audit.offset(), cpu_seconds(proc.pid)
        start = time.monotonic()
        apply_workload(api, namespace, workload(isvcs, quotas, gpu_node_tolerations=True))
        applied = time.monotonic() - start
        converge = wait_converged(api, namespace, isvcs, quotas, start)
        time.sleep(3)  # what the operator still writes after convergence counts too
        cpu = cpu_seconds(proc.pid) - cpu0
        ours = [e for e in writes(audit.events(start_offset), [OPERATOR_SA]) if e.namespace == namespace]
    return Run(converge, applied, len(ours) / (isvcs + quotas), cpu)


def emulator_run(isvcs: int, quotas: int) -> Run:
    """The same burst on the emulated API server (kmock in a subprocess of its own)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.cluster.emulated", str(isvcs), str(quotas)],
        capture_output=True, text=True, timeout=1200, check=True,
    )  # fmt: skip
    converge, applied, per_object, cpu = (float(x) for x in done.stdout.split()[-4:])
    return Run(converge, applied, per_object, cpu)


def operator_kubeconfig(cluster: local.Cluster, folder: Path) -> Path:
    """A kubeconfig with a token of the chart's ``kvfleet-operator`` service account (its RBAC)."""
    token = cluster.kubectl(
        "create", "token", "kvfleet-operator", "-n", local.NAMESPACE, "--duration=2h"
    ).strip()
    cfg = json.loads(cluster.kubeconfig.read_text())
    cfg["users"] = [{"name": "kvfleet-operator", "user": {"token": token}}]
    cfg["contexts"][0]["context"]["user"] = "kvfleet-operator"
    path = folder / "operator.kubeconfig"
    path.write_text(json.dumps(cfg))
    return path


def summary(label: str, runs: list[Run], field: Callable[[Run], float], unit: str) -> str:
    values = [field(r) for r in runs]
    return f"  {label:32s} median {statistics.median(values):8.2f} {unit}  (runs: {', '.join(f'{v:.2f}' for v in values)})"


def report(side: str, runs: list[Run]) -> None:
    print(f"{side}:")
    print(summary("converge (from the first apply)", runs, lambda r: r.converge_s, "s"))
    print(summary("  of which the burst's own applies", runs, lambda r: r.apply_s, "s"))
    print(summary("operator API writes per object", runs, lambda r: r.writes_per_object, ""))
    print(summary("operator CPU", runs, lambda r: r.cpu_s, "s"))


def main(runs: int, isvcs: int, quotas: int) -> None:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    print(
        f"{isvcs} InferenceServices + {quotas} TenantQuotas applied in a burst; {runs} runs a side; {os.cpu_count()} CPUs ({cpu})"
    )
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        cluster = local.up(Path(tmp) / "cluster", install=False)
        try:
            local.install_kvfleet(cluster, ("--set", "operator.replicas=0", "--set", "router.enabled=false"))
            local.widen_gpu_node(cluster, gpus=isvcs + 8)
            kubeconfig = operator_kubeconfig(cluster, Path(tmp))
            real = [real_run(cluster, kubeconfig, n, isvcs, quotas) for n in range(runs)]
        finally:
            cluster.stop()
    emulated = [emulator_run(isvcs, quotas) for _ in range(runs)]
    report("real control plane (kube-apiserver v1.37.2 + etcd, controllers, kwok node)", real)
    report("emulated API server (kmock + operator/testing/apiserver.py)", emulated)
    ratio = statistics.median(r.converge_s for r in real) / statistics.median(r.converge_s for r in emulated)
    print(f"converge, real / emulated: {ratio:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--inferenceservices", type=int, default=50)
    parser.add_argument("--tenantquotas", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(asyncio.to_thread(main, args.runs, args.inferenceservices, args.tenantquotas))
