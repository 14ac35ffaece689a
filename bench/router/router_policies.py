"""Figure 2: routing policies on 8 simulated engines, a shared-prefix chat workload.

Chat requests whose system prompts are drawn from 16 long prefixes; each engine's
KV cache holds only a few of them, so where a request goes decides whether its
prefix is a cache hit. For each policy, fresh engines, the same open-loop arrivals:
TTFT p50/p99, the engines' prefix-cache hit rate, goodput (TTFT ≤ 1 s and
TPOT ≤ 100 ms). Run: ``.venv/bin/python -m bench.router.router_policies``.
"""

from __future__ import annotations

import argparse
import asyncio

from bench.common import publish
from bench.router.router_fleet import (
    ChatWorkload,
    EngineFlags,
    drive,
    engines,
    header,
    kvfleet_router,
    ms,
    prefix_counts,
    summary,
)

POLICIES = ["round-robin", "least-request", "kv-aware", "prefix-aware", "default"]
FLAGS = EngineFlags(max_num_seqs=8, num_kv_blocks=160, base_ms=10.0, per_token_ms=2.0)
SLO_TTFT, SLO_TPOT = 1.0, 0.1


def run_policy(policy: str, n: int, rate: float, workload: ChatWorkload, warmup: int) -> tuple[object, float]:
    with (
        engines(8, FLAGS) as urls,
        kvfleet_router(urls, ["--policy", policy, "--chars-per-token", "1"], cpus="0") as router,
    ):
        bodies = workload.bodies(warmup + n)
        asyncio.run(drive(router, bodies[:warmup], rate=rate, seed=1))  # caches warm, not measured
        h0, q0 = prefix_counts(urls)
        records, duration = asyncio.run(drive(router, bodies[warmup:], rate=rate, seed=2))
        h1, q1 = prefix_counts(urls)
    hit = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    return summary(records, duration, SLO_TTFT, SLO_TPOT), hit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--warmup", type=int, default=40, help="requests sent first and not measured")
    args = ap.parse_args()
    workload = ChatWorkload()
    lines = [
        header(
            f"policies: 8 engines, {workload.groups} shared system prompts, {args.requests} requests at {args.rate}/s"
        )
    ]
    lines.append(
        f"{'policy':<15}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'prefix hit':>11}{'goodput/s':>10}{'failed':>7}"
    )
    results = {}
    for policy in args.policies.split(","):
        s, hit = run_policy(policy, args.requests, args.rate, workload, args.warmup)
        results[policy] = s
        lines.append(f"{policy:<15}{ms(s.ttft.p50 if s.ttft else None):>12}{ms(s.ttft.p99 if s.ttft else None):>12}"
                     f"{hit:>11.2f}{s.goodput:>10.2f}{s.num_failed:>7} {s.errors or ''}")  # fmt: skip
        print(lines[-1], flush=True)
    rr = results["round-robin"].ttft if "round-robin" in results else None
    df = results["default"].ttft if "default" in results else None
    if rr and df:
        lines.append(f"default TTFT p99 / round-robin TTFT p99 = {df.p99 / rr.p99:.2f} (target <= 0.5)")
    publish(lines, "router_policies.txt")


if __name__ == "__main__":
    main()
