"""Figure 4: kvfleet's router beside vLLM's own router (``vllm-router``, Rust) on the same engines.

Part A, the figure-2 workload (8 simulated engines, 16 shared system prompts, the
same open-loop arrivals): TTFT p50/p99 and prefix-cache hit rate for kvfleet
``default`` and vllm-router ``cache_aware`` and ``power_of_two``. Part B, the
request-rate ceiling of each router in front of one fast engine (closed loop,
1-token answers), each router pinned to one core.
Run: ``.venv/bin/python bench/router_vs_vllm.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Iterator

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
    vllm_router,
)  # fmt: skip
from router_overhead import bodies
from router_policies import FLAGS, SLO_TPOT, SLO_TTFT

ROUTERS = [
    ("kvfleet default", "default"),
    ("vllm cache_aware", "cache_aware"),
    ("vllm power_of_two", "power_of_two"),
]


@contextlib.contextmanager
def front(name: str, policy: str, urls: list[str]) -> Iterator[str]:
    ctx = kvfleet_router(urls, ["--policy", policy], cpus="0") if name.startswith("kvfleet") else vllm_router(
        urls, policy, cpus="0")  # fmt: skip
    with ctx as url:
        yield url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--ceiling-requests", type=int, default=600)
    args = ap.parse_args()
    workload = ChatWorkload()
    lines = [header("kvfleet router vs vllm-router on the same simulated engines")]
    lines.append(f"A: 8 engines, {workload.groups} system prompts, {args.requests} requests at {args.rate}/s")
    lines.append(
        f"{'router':<19}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'prefix hit':>11}{'goodput/s':>10}{'failed':>7}"
    )
    for name, policy in ROUTERS:
        with engines(8, FLAGS) as urls, front(name, policy, urls) as url:
            h0, q0 = prefix_counts(urls)
            recs, dur = asyncio.run(drive(url, workload.bodies(args.requests), rate=args.rate, seed=1))
            h1, q1 = prefix_counts(urls)
        s = summary(recs, dur, SLO_TTFT, SLO_TPOT)
        hit = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        lines.append(f"{name:<19}{ms(s.ttft.p50 if s.ttft else None):>12}{ms(s.ttft.p99 if s.ttft else None):>12}"
                     f"{hit:>11.2f}{s.goodput:>10.2f}{s.num_failed:>7} {s.errors or ''}")  # fmt: skip
        print(lines[-1], flush=True)
    lines.append("B: request-rate ceiling, 1 fast engine, 32 clients, 1-token answers")
    fast = EngineFlags(max_num_seqs=128, base_ms=2.0, per_token_ms=0.0)
    with engines(1, fast, cpus="1") as urls:
        recs, dur = asyncio.run(
            drive(urls[0], bodies(args.ceiling_requests, 1), concurrency=32, endpoint="completions")
        )
        base = summary(recs, dur).request_throughput
        lines.append(f"{'direct':<19}{base:>8.1f} req/s")
        for name, policy in [("kvfleet default", "default"), ("vllm cache_aware", "cache_aware")]:
            with front(name, policy, urls) as url:
                recs, dur = asyncio.run(drive(url, bodies(args.ceiling_requests, 1), concurrency=32,
                                              endpoint="completions"))  # fmt: skip
            s = summary(recs, dur)
            lines.append(f"{name:<19}{s.request_throughput:>8.1f} req/s ({s.request_throughput / base:.2f} of direct, "
                         f"TTFT p50 {ms(s.ttft.p50 if s.ttft else None)} ms, failed {s.num_failed})")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    (RESULTS / "router_vs_vllm.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
