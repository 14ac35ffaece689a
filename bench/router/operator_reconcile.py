"""How fast and how cheaply `kvfleet operator` reconciles InferenceServices, on the emulated API server.

The operator runs as a user runs it (``kvfleet operator --namespace default`` in its own
process, found through KUBECONFIG); the API server is kmock's emulator with admission
(``operator/testing/apiserver.py``) in this process. Printed:

- apply → Deployment created latency, p50/p99 over N InferenceServices applied in a burst,
  against the baseline of the same client creating one Deployment directly;
- operator CPU seconds per 100 InferenceServices reconciled (their three children), from
  /proc of the operator process, against the baseline of this process's CPU to send the
  same 300 child objects directly.

Run: .venv/bin/python -m bench.router.operator_reconcile [--latency-count 50] [--cpu-count 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import kmock
from kmock._internal import enums

from kvfleet.operator.testing.apiserver import ApiServer, register, write_kubeconfig
from kvfleet.operator.testing.cluster import User, inferenceservice
from kvfleet.operator.testing.harness import kubeconfig_for

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@attrs.define(kw_only=True)
class TimedApiServer(ApiServer):
    """The emulator, noting when each Deployment create arrived and which services got their last child."""

    created: dict[str, float] = attrs.field(factory=dict, init=False)
    finished: set[str] = attrs.field(factory=set, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        plural = request.resource.plural if request.resource else None
        if request.action == enums.action.CREATE and plural == "deployments":
            self.created[request.data["metadata"]["name"]] = time.perf_counter()
        if request.action == enums.action.CREATE and plural == "poddisruptionbudgets":
            self.finished.add(request.data["metadata"]["name"])  # the last child of a reconciliation
        return await super()._handle(request)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def all_done(server: TimedApiServer, names: list[str], timeout: float) -> None:
    """Until every name has its last child (checked twice a second: the bench shares 2 CPUs)."""
    deadline = time.monotonic() + timeout
    while not server.finished.issuperset(names):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(set(names) - server.finished)} of {len(names)} not reconciled in {timeout}s"
            )
        await asyncio.sleep(0.5)


async def apply_burst(user: User, names: list[str]) -> dict[str, float]:
    applied: dict[str, float] = {}
    for name in names:
        applied[name] = time.perf_counter()
        await user.apply(inferenceservice(name))
    return applied


BASELINE = """
import os, sys, time
from kvfleet.operator import renderers
from kvfleet.kubeconfig import client_configuration
from kvfleet.operator.kube import KubeApi, api_client
from kvfleet.operator.spec import parse_inferenceservice
from kvfleet.operator.testing.cluster import inferenceservice
api = KubeApi(api_client(client_configuration()))
spec = parse_inferenceservice(inferenceservice()["spec"])
objs = [renderers.render_children(renderers.Owner(f"base-{i:03d}", "default", "uid"), spec, "img") for i in range(int(sys.argv[1]))]
cpu0, lat = time.process_time(), []
for children in objs:
    for i, obj in enumerate(children):
        start = time.perf_counter()
        api.create(obj)
        if i == 0:
            lat.append(time.perf_counter() - start)
lat.sort()
print(lat[len(lat) // 2], time.process_time() - cpu0)
"""


async def baseline_create(env: dict[str, str], count: int) -> tuple[float, float]:
    """A separate process sending the same children directly with the operator's client: median seconds
    for one Deployment create, and its CPU seconds for all ``count`` × 3 creates."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BASELINE, str(count), env=env, stdout=subprocess.PIPE
    )
    out, _ = await proc.communicate()
    median, cpu = out.split()
    return float(median), float(cpu)


async def main(latency_count: int, cpu_count: int) -> None:
    async with TimedApiServer() as server, kmock.Server(server):
        register(server)
        with tempfile.TemporaryDirectory() as tmp, kubeconfig_for(server, Path(tmp)) as client:
            kubeconfig = write_kubeconfig(Path(tmp) / "operator-kubeconfig", server)
            env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
            cmd = [sys.executable, "-m", "kvfleet.cli", "operator", "--namespace", "default", "--standalone"]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                user = User(client)
                await user.apply(inferenceservice("warmup"))
                await all_done(server, ["warmup"], timeout=120)
                names = [f"lat-{i:03d}" for i in range(latency_count)]
                applied = await apply_burst(user, names)
                await all_done(server, names, timeout=600)
                latencies = [server.created[n] - applied[n] for n in names]
                cpu_names = [f"cpu-{i:03d}" for i in range(cpu_count)]
                cpu0 = cpu_seconds(proc.pid)
                await apply_burst(user, cpu_names)
                await all_done(server, cpu_names, timeout=900)
                operator_cpu = cpu_seconds(proc.pid) - cpu0
            finally:
                proc.terminate()  # kopf stops gracefully: the emulator must keep serving meanwhile
                await asyncio.to_thread(proc.wait, 60)
            direct, direct_cpu = await baseline_create(env, cpu_count)
    per100 = operator_cpu * 100 / cpu_count
    base100 = direct_cpu * 100 / cpu_count
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    print(
        f"apply -> Deployment created, {latency_count} InferenceServices applied in a burst (emulated API server):"
    )
    print(f"  p50 {p50 * 1000:8.1f} ms   p99 {p99 * 1000:8.1f} ms   max {max(latencies) * 1000:8.1f} ms")
    print(
        f"  baseline: one direct Deployment create {direct * 1000:.1f} ms -> p50 is {p50 / direct:.1f}x, p99 {p99 / direct:.1f}x"
    )
    print(
        f"operator CPU per 100 InferenceServices reconciled (children + status + kopf's bookkeeping): {per100:.2f} s"
    )
    print(
        f"  baseline: a process sending the same 300 children directly uses {base100:.2f} s CPU -> {per100 / base100:.1f}x"
    )
    print(f"  ({cpu_count} reconciled, {os.cpu_count()} CPUs, operator process measured from /proc)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-count", type=int, default=50)
    parser.add_argument("--cpu-count", type=int, default=100)
    args = parser.parse_args()
    asyncio.run(main(args.latency_count, args.cpu_count))
