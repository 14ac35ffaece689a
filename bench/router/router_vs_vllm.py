"""Figure 4: kvfleet's router beside vLLM's own router (``vllm-router``, Rust) on the same engines.

Part A, the figure-2 workload (8 simulated engines, 16 shared system prompts, the
same open-loop arrivals): TTFT p50/p99 and prefix-cache hit rate for kvfleet
``default`` and vllm-router ``cache_aware`` and ``power_of_two``. Part B, the
cost of each router in front of one fast engine (1-token answers): the router alone on
one core, the engine and the load client on the other, so the router's own cost is
measured apart from the client's. Per router it prints the added TTFT at low load (one
closed-loop client, against going direct), the request-rate ceiling (many clients), and
the router process's CPU seconds per request (``/proc/PID/stat`` utime + stime, all
threads) at both loads: "overhead within 2x" compares CPU per request and added TTFT.
Run: ``.venv/bin/python -m bench.router.router_vs_vllm``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Iterator
from typing import NamedTuple

from bench.common import RESULTS, Flag, bench_args, cpu_seconds
from bench.router.router_fleet import (
    ChatWorkload,
    EngineFlags,
    Front,
    bodies,
    drive,
    engines,
    header,
    kvfleet_front,
    ms,
    pinned_here,
    prefix_counts,
    summary,
    vllm_router,
)  # fmt: skip
from bench.router.router_policies import FLAGS, SLO_TPOT, SLO_TTFT
from kvfleet.bench.stats import BenchSummary

ROUTERS = [
    ("kvfleet default", "default"),
    ("vllm cache_aware", "cache_aware"),
    ("vllm power_of_two", "power_of_two"),
]
ROUTER_CPU, CLIENT_CPU = "1", 0  # part B: each router alone on CPU 1; the engine and this client on CPU 0


@contextlib.contextmanager
def front(name: str, policy: str, urls: list[str]) -> Iterator[Front]:
    """The named router, pinned to ``ROUTER_CPU`` whichever it is."""
    ctx = kvfleet_front(urls, ["--policy", policy], cpus=ROUTER_CPU) if name.startswith("kvfleet") else vllm_router(
        urls, policy, cpus=ROUTER_CPU)  # fmt: skip
    with ctx as f:
        yield f


class Run(NamedTuple):
    summary: BenchSummary
    cpu_per_request: float | None  # the router process's CPU seconds per request; None going direct


def closed_loop(url: str, pid: int | None, n: int, clients: int) -> Run:
    """``n`` 1-token completions from ``clients`` closed-loop clients, with the router's CPU time around them."""
    before = cpu_seconds(pid) if pid is not None else 0.0
    recs, dur = asyncio.run(drive(url, bodies(n, 1), concurrency=clients, endpoint="completions"))
    cpu = (cpu_seconds(pid) - before) / len(recs) if pid is not None else None
    return Run(summary(recs, dur), cpu)


def part_a(args: argparse.Namespace, lines: list[str]) -> None:
    workload = ChatWorkload()
    lines.append(f"A: 8 engines, {workload.groups} system prompts, {args.requests} requests at {args.rate}/s")
    lines.append(
        f"{'router':<19}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'prefix hit':>11}{'goodput/s':>10}{'failed':>7}"
    )
    for name, policy in ROUTERS:
        with engines(8, FLAGS) as urls, front(name, policy, urls) as f:
            h0, q0 = prefix_counts(urls)
            recs, dur = asyncio.run(drive(f.url, workload.bodies(args.requests), rate=args.rate, seed=1))
            h1, q1 = prefix_counts(urls)
        s = summary(recs, dur, SLO_TTFT, SLO_TPOT)
        hit = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
        lines.append(f"{name:<19}{ms(s.ttft.p50 if s.ttft else None):>12}{ms(s.ttft.p99 if s.ttft else None):>12}"
                     f"{hit:>11.2f}{s.goodput:>10.2f}{s.num_failed:>7} {s.errors or ''}")  # fmt: skip
        print(lines[-1], flush=True)


def us(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e6:.0f}"


def part_b(args: argparse.Namespace, lines: list[str]) -> None:
    lines.append(f"B: 1 fast engine and the client on CPU {CLIENT_CPU}, each router alone on CPU {ROUTER_CPU}; "
                 f"low load = 1 client, {args.low_requests} requests; ceiling = {args.clients} clients, "
                 f"{args.ceiling_requests} requests; 1-token answers")  # fmt: skip
    lines.append(f"{'path':<19}{'low p50 ms':>11}{'low p99 ms':>11}{'added p50':>10}{'added p99':>10}"
                 f"{'ceiling/s':>10}{'CPU us/req low':>15}{'CPU us/req ceil':>16}{'failed':>7}")  # fmt: skip
    fast = EngineFlags(max_num_seqs=128, base_ms=2.0, per_token_ms=0.0)
    runs: dict[str, tuple[Run, Run]] = {}
    with pinned_here(CLIENT_CPU), engines(1, fast, cpus=str(CLIENT_CPU)) as urls:
        runs["direct"] = (closed_loop(urls[0], None, args.low_requests, 1),
                          closed_loop(urls[0], None, args.ceiling_requests, args.clients))  # fmt: skip
        for name, policy in [("kvfleet default", "default"), ("vllm cache_aware", "cache_aware")]:
            with front(name, policy, urls) as f:
                runs[name] = (closed_loop(f.url, f.pid, args.low_requests, 1),
                              closed_loop(f.url, f.pid, args.ceiling_requests, args.clients))  # fmt: skip
    d_low = runs["direct"][0].summary.ttft
    for name, (low, ceil) in runs.items():
        t = low.summary.ttft
        add50 = t.p50 - d_low.p50 if t and d_low and name != "direct" else None
        add99 = t.p99 - d_low.p99 if t and d_low and name != "direct" else None
        lines.append(f"{name:<19}{ms(t.p50 if t else None):>11}{ms(t.p99 if t else None):>11}{ms(add50):>10}"
                     f"{ms(add99):>10}{ceil.summary.request_throughput:>10.1f}{us(low.cpu_per_request):>15}"
                     f"{us(ceil.cpu_per_request):>16}{low.summary.num_failed + ceil.summary.num_failed:>7}")  # fmt: skip
    lines.append(ratios(runs))


def ratios(runs: dict[str, tuple[Run, Run]]) -> str:
    """kvfleet over vllm cache_aware: router CPU per request (low load, ceiling) and added TTFT p50."""
    (kl, kc), (vl, vc) = runs["kvfleet default"], runs["vllm cache_aware"]
    d = runs["direct"][0].summary.ttft

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "-"

    def added(run: Run) -> float | None:
        t = run.summary.ttft
        return t.p50 - d.p50 if t and d else None

    return (f"kvfleet / vllm cache_aware: router CPU per request {ratio(kl.cpu_per_request, vl.cpu_per_request)} "
            f"at low load, {ratio(kc.cpu_per_request, vc.cpu_per_request)} at the ceiling; "
            f"added TTFT p50 {ratio(added(kl), added(vl))} (target: within 2x)")  # fmt: skip


def main() -> None:
    args = bench_args(
        __doc__,
        requests=240,
        rate=12.0,
        low_requests=300,
        ceiling_requests=600,
        clients=32,
        skip_a=Flag(False, "only part B"),
    )
    lines = [header("kvfleet router vs vllm-router on the same simulated engines")]
    if not args.skip_a:
        part_a(args, lines)
    part_b(args, lines)
    text = "\n".join(lines)
    print(text)
    if not args.skip_a:
        (RESULTS / "router_vs_vllm.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
