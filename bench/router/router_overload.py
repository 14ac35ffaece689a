"""Figure 3: overload at 2x capacity, goodput with and without admission control.

Two simulated engines of 4 slots each. Capacity is measured first (closed loop, one
client per slot); then an open loop at twice that rate goes through the router with
admission control (requests wait in the router's queue at most 0.3 s, a third of the TTFT budget, then are shed) and
without (``--no-admission``: everything is sent on, engine queues grow). Goodput:
requests with TTFT ≤ 1 s and TPOT ≤ 100 ms, per second. The load is the fault suite's
(:mod:`kvfleet.testing.fault_load`: one connection per request, every request classified),
so the table also says that nothing was lost: each shed request got a clean OpenAI error.
Run: ``.venv/bin/python -m bench.router.router_overload``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import publish
from bench.router.router_fleet import KEY, EngineFlags, engines, header, kvfleet_router, ms
from kvfleet.bench.stats import BenchSummary, summarize
from kvfleet.testing.fault_load import LoadSpec, Tally, Tenant, run_load

FLAGS = EngineFlags(max_num_seqs=4, num_kv_blocks=512, base_ms=40.0, per_token_ms=0.1)
SLO_TTFT, SLO_TPOT = 1.0, 0.1


def drive(url: str, requests: int, rate: float | None = None) -> tuple[BenchSummary, Tally]:
    """``requests`` 12-token streams, closed loop (8 clients) or open loop at ``rate``; summary and counts."""
    spec = LoadSpec([url], [Tenant("bench", KEY)], requests=requests, concurrency=8, rate=rate, max_tokens=12,
                    bound_s=120.0, seed=2)  # fmt: skip
    start = time.perf_counter()
    tally = asyncio.run(run_load(spec))
    records = [o.record() for o in tally.outcomes]
    return summarize(records, time.perf_counter() - start, slo_ttft_s=SLO_TTFT, slo_tpot_s=SLO_TPOT), tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args()
    lines = [header("overload at 2x capacity: admission control on and off")]
    with engines(2, FLAGS) as urls:
        with kvfleet_router(urls, ["--max-engine-queue", "0"], cpus="0") as router:
            cap, _ = drive(router, 120)
        capacity = cap.goodput or 0.0
        rate = 2 * cap.request_throughput
        lines.append(
            f"capacity (closed loop, 8 clients): {cap.request_throughput:.2f} req/s, goodput {capacity:.2f}/s"
        )
        rows = []
        for name, extra in [("admission on", ["--max-engine-queue", "0", "--max-queue-wait", "0.3"]),
                            ("admission off", ["--no-admission"])]:  # fmt: skip
            with kvfleet_router(urls, extra, cpus="0") as router:
                rows.append((name, *drive(router, args.requests, rate=rate)))
    lines.append(
        f"offered: {rate:.2f} req/s, {args.requests} requests, SLO TTFT {SLO_TTFT}s TPOT {SLO_TPOT}s"
    )
    lines.append(
        f"{'router':<15}{'goodput/s':>10}{'of capacity':>12}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'shed':>6}"
        f"{'lost':>6}"
    )
    for name, s, tally in rows:
        share = (s.goodput or 0.0) / capacity if capacity else 0.0
        lines.append(f"{name:<15}{s.goodput:>10.2f}{share:>11.0%} {ms(s.ttft.p50 if s.ttft else None):>12}"
                     f"{ms(s.ttft.p99 if s.ttft else None):>12}{tally.count('clean_error'):>6}{len(tally.lost):>6}")  # fmt: skip
    publish(lines, "router_overload.txt")


if __name__ == "__main__":
    main()
