"""Figure 1: what the router adds, against going straight to one simulated engine.

Added TTFT at p50/p99 (light closed-loop load, 1-token-per-step engine) and the
request-rate ceiling (closed loop, 1-token answers, many clients), with the router alone
on CPU 1 and the engine and this load client on CPU 0; the router process's CPU seconds
per request (``/proc/PID/stat``) are printed beside them. Run: ``.venv/bin/python -m bench.router.router_overhead``.
"""

from __future__ import annotations

import asyncio

from bench.common import cpu_seconds, publish
from bench.router import router_fleet as fleet
from kvfleet.bench.stats import BenchSummary


def measure(url: str, n: int, ceiling_n: int, ceiling_clients: int) -> tuple[BenchSummary, BenchSummary]:
    light, t1 = asyncio.run(fleet.drive(url, fleet.bodies(n, 8), concurrency=2, endpoint="completions"))
    heavy, t2 = asyncio.run(
        fleet.drive(url, fleet.bodies(ceiling_n, 1), concurrency=ceiling_clients, endpoint="completions")
    )
    return fleet.summary(light, t1), fleet.summary(heavy, t2)


def main() -> None:
    args = fleet.overhead_args(__doc__)
    flags = fleet.EngineFlags(max_num_seqs=128, base_ms=2.0, per_token_ms=0.0)
    lines = [fleet.header("router overhead: kvfleet router vs straight to one simulated engine")]
    with fleet.pinned_here(0), fleet.engines(1, flags, cpus="0") as urls:
        direct_light, direct_heavy = measure(urls[0], args.requests, args.ceiling_requests, args.clients)
        with fleet.kvfleet_front(urls, cpus="1") as router:
            before = cpu_seconds(router.pid)
            routed_light, routed_heavy = measure(
                router.url, args.requests, args.ceiling_requests, args.clients
            )
            cpu = (cpu_seconds(router.pid) - before) / (args.requests + args.ceiling_requests)
    rows = [("direct", direct_light, direct_heavy), ("kvfleet router", routed_light, routed_heavy)]
    lines.append(f"{'path':<16}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'ceiling req/s':>15}{'failed':>8}")
    for name, light, heavy in rows:
        lines.append(f"{name:<16}{fleet.ms(light.ttft.p50):>12}{fleet.ms(light.ttft.p99):>12}"
                     f"{heavy.request_throughput:>15.1f}{light.num_failed + heavy.num_failed:>8}")  # fmt: skip
    added50 = routed_light.ttft.p50 - direct_light.ttft.p50
    added99 = routed_light.ttft.p99 - direct_light.ttft.p99
    lines.append(f"added TTFT: p50 {fleet.ms(added50)} ms, p99 {fleet.ms(added99)} ms; "
                 f"ceiling ratio router/direct {routed_heavy.request_throughput / direct_heavy.request_throughput:.2f}; "
                 f"router CPU {cpu * 1e6:.0f} us per request")  # fmt: skip
    publish(lines, "router_overhead.txt")


if __name__ == "__main__":
    main()
