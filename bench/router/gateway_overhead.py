"""What the Envoy gateway adds: Envoy + ext_proc vs the router's own proxy vs straight to the engine.

One simulated engine (``kvfleet engine --simulate``, 1 token per 2 ms step), one
``kvfleet router --envoy-xds-port`` process (its HTTP proxy and its ext_proc/ADS server,
so both router paths decide with the same state) and the real Envoy bootstrapped from
it. TTFT p50/p99 under light closed-loop load (2 clients, 8-token streams) and the
request-rate ceiling (many clients, 1-token streams), each path measured in the same run.
Pinning: the engine on core 1; the router and Envoy share core 0.
Run: ``.venv/bin/python -m bench.router.gateway_overhead``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from bench.common import publish
from bench.router.router_fleet import (
    EngineFlags,
    bodies,
    drive,
    engines,
    free_port,
    header,
    kvfleet_router,
    ms,
    overhead_args,
    summary,
)
from kvfleet.bench.stats import BenchSummary
from kvfleet.router.gateway.process import EnvoyProcess
from kvfleet.router.gateway_config import GatewayConfig


@dataclass(frozen=True)
class Measured:
    light: BenchSummary
    heavy: BenchSummary
    errors: Counter[str]


def measure(url: str, n: int, ceiling_n: int, clients: int) -> Measured:
    asyncio.run(drive(url, bodies(20, 2), concurrency=2, endpoint="completions"))  # warm connections up
    light, t1 = asyncio.run(drive(url, bodies(n, 8), concurrency=2, endpoint="completions"))
    heavy, t2 = asyncio.run(drive(url, bodies(ceiling_n, 1), concurrency=clients, endpoint="completions"))
    errors = Counter(r.error or "?" for r in light + heavy if not r.ok)
    return Measured(summary(light, t1), summary(heavy, t2), errors)


@contextlib.contextmanager
def pinned_envoy(config: GatewayConfig, cpus: str) -> Iterator[EnvoyProcess]:
    envoy = EnvoyProcess(config).start(timeout_s=120)
    try:
        if shutil.which("taskset") and envoy.process is not None:
            subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(envoy.process.pid)], check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
        yield envoy
    finally:
        envoy.stop()


def main() -> None:
    args = overhead_args(__doc__)
    flags = EngineFlags(max_num_seqs=128, base_ms=2.0, per_token_ms=0.0)
    gw = GatewayConfig(xds_port=free_port(), listen_port=free_port(), admin_port=free_port())
    extra = ["--envoy-xds-port", str(gw.xds_port), "--envoy-port", str(gw.listen_port),
             "--envoy-admin-port", str(gw.admin_port)]  # fmt: skip
    results: dict[str, Measured] = {}
    with engines(1, flags, cpus="1") as urls:
        results["direct"] = measure(urls[0], args.requests, args.ceiling_requests, args.clients)
        with kvfleet_router(urls, extra=extra, cpus="0") as router, pinned_envoy(gw, cpus="0") as envoy:
            results["router proxy"] = measure(router, args.requests, args.ceiling_requests, args.clients)
            results["envoy+ext_proc"] = measure(envoy.url, args.requests, args.ceiling_requests, args.clients)
    lines = [header("gateway overhead: Envoy + ext_proc vs the router's proxy vs straight to one engine")]
    lines.append(f"{'path':<16}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'ceiling req/s':>15}{'failed':>8}")
    for name, m in results.items():
        lines.append(f"{name:<16}{ms(m.light.ttft.p50):>12}{ms(m.light.ttft.p99):>12}"
                     f"{m.heavy.request_throughput:>15.1f}{sum(m.errors.values()):>8}")  # fmt: skip
    d, r, e = results["direct"], results["router proxy"], results["envoy+ext_proc"]
    for name, m in (("router proxy", r), ("envoy+ext_proc", e)):
        lines.append(f"{name}: added TTFT p50 {ms(m.light.ttft.p50 - d.light.ttft.p50)} ms, "
                     f"p99 {ms(m.light.ttft.p99 - d.light.ttft.p99)} ms; "
                     f"ceiling / direct {m.heavy.request_throughput / d.heavy.request_throughput:.2f}")  # fmt: skip
    lines.append(f"envoy+ext_proc / router proxy: TTFT p50 {e.light.ttft.p50 / r.light.ttft.p50:.2f}x, "
                 f"ceiling {e.heavy.request_throughput / r.heavy.request_throughput:.2f}x")  # fmt: skip
    for name, m in results.items():
        if m.errors:
            lines.append(f"{name} failures: " + ", ".join(f"{k} x{v}" for k, v in m.errors.most_common()))
    publish(lines, "gateway_overhead.txt")


if __name__ == "__main__":
    main()
