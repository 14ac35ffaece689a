"""Figure 2: routing policies on 8 simulated engines, a shared-prefix chat workload.

Chat requests whose system prompts are drawn from 16 long prefixes; each engine's
KV cache holds only a few of them, so where a request goes decides whether its
prefix is a cache hit. For each policy, fresh engines, the same open-loop arrivals:
TTFT p50/p99, the engines' prefix-cache hit rate, goodput (TTFT ≤ 500 ms and
TPOT ≤ 50 ms). Run: ``.venv/bin/python bench/router_policies.py``.
"""

from __future__ import annotations

import argparse
import asyncio

from router_fleet import (
    RESULTS,
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
FLAGS = EngineFlags(max_num_seqs=8, num_kv_blocks=160, base_ms=8.0, per_token_ms=0.4)
SLO_TTFT, SLO_TPOT = 0.5, 0.05


def run_policy(policy: str, n: int, rate: float, workload: ChatWorkload) -> tuple[object, float]:
    with engines(8, FLAGS) as urls, kvfleet_router(urls, ["--policy", policy], cpus="0") as router:
        h0, q0 = prefix_counts(urls)
        records, duration = asyncio.run(drive(router, workload.bodies(n), rate=rate, seed=1))
        h1, q1 = prefix_counts(urls)
    hit = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    return summary(records, duration, SLO_TTFT, SLO_TPOT), hit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=12.0)
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
    for policy in POLICIES:
        s, hit = run_policy(policy, args.requests, args.rate, workload)
        results[policy] = s
        lines.append(f"{policy:<15}{ms(s.ttft.p50 if s.ttft else None):>12}{ms(s.ttft.p99 if s.ttft else None):>12}"
                     f"{hit:>11.2f}{s.goodput:>10.2f}{s.num_failed:>7}")  # fmt: skip
        print(lines[-1], flush=True)
    rr, df = results["round-robin"].ttft, results["default"].ttft
    if rr and df:
        lines.append(f"default TTFT p99 / round-robin TTFT p99 = {df.p99 / rr.p99:.2f} (target <= 0.5)")
    text = "\n".join(lines)
    print(text)
    (RESULTS / "router_policies.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
