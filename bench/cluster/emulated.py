"""The reconcile benchmark's burst on the emulated API server (kmock + operator/testing/apiserver.py),
in a process of its own; prints ``converge_s apply_s writes_per_object cpu_s`` (bench.cluster.reconcile_scale).

Operator writes: every POST/PUT/PATCH/DELETE the server counted, less the benchmark's own creates
(one per InferenceService, two per TenantQuota: it and its Secret). The server keeps a short request
log (``keep_log``): kmock scans the whole log on every request, which at this size made the emulator
slow quadratically (450 creates alone: 22 s, and no convergence within 10 minutes under the operator).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import kmock

from kvfleet.operator.testing.apiserver import ApiServer, register, write_kubeconfig

from .reconcile_scale import wait_converged
from .workload import Api, apply_workload, cpu_seconds, operator_process, workload

WRITES = {"POST", "PUT", "PATCH", "DELETE"}


def burst(server: ApiServer, kubeconfig: Path, isvcs: int, quotas: int) -> tuple[float, float, float, float]:
    with operator_process(kubeconfig) as proc:
        api = Api(kubeconfig)
        time.sleep(5)  # the operator's watches established
        seen, cpu0 = _writes(server), cpu_seconds(proc.pid)
        start = time.monotonic()
        apply_workload(api, "default", workload(isvcs, quotas, gpu_node_tolerations=True))
        applied = time.monotonic() - start
        converge = wait_converged(api, "default", isvcs, quotas, start)
        time.sleep(3)
        cpu = cpu_seconds(proc.pid) - cpu0
        written = _writes(server) - seen
    operator_writes = written - (isvcs + 2 * quotas)
    return converge, applied, operator_writes / (isvcs + quotas), cpu


def _writes(server: ApiServer) -> int:
    return sum(n for method, n in server.methods.items() if method in WRITES)


async def main(isvcs: int, quotas: int) -> None:
    async with ApiServer(keep_log=64) as server, kmock.Server(server):
        register(server)
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = write_kubeconfig(Path(tmp) / "kubeconfig", server)
            converge, applied, per_object, cpu = await asyncio.to_thread(
                burst, server, kubeconfig, isvcs, quotas
            )
    print(f"{converge:.3f} {applied:.3f} {per_object:.3f} {cpu:.3f}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
