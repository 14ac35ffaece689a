"""Figure: adapter-aware vs least-request routing on a simulated multi-LoRA fleet (issue #15).

8 simulated engines, each configured with the same 32 LoRA adapters and room for 4 on its
device (``--max-loras 4``); loading an adapter costs ``--sim-lora-load-ms`` (50 ms) of
simulated time, and with all 4 slots busy a request waits. Chat requests name an adapter
drawn from a Zipf popularity (s = 0.8) over the 32. For each policy, fresh engines and the
same open-loop arrivals: TTFT p50/p99 and the adapter loads per minute the engines counted
(``kvfleet:lora_loads_total``) while measuring. ``default`` is adapter-aware for requests
naming an adapter. Run: ``.venv/bin/python -m bench.router.lora_routing``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
from collections.abc import Sequence

import httpx

import bench.router.router_fleet as rf
from bench.common import publish
from kvfleet.testing.processes import lora_flags

ADAPTERS = [f"lora-{i:02d}" for i in range(32)]
FLAGS = rf.EngineFlags(max_num_seqs=8, num_kv_blocks=256, base_ms=10.0, per_token_ms=1.0)
LORA = lora_flags(ADAPTERS, max_loras=4, load_ms=50.0)
POLICIES = ["least-request", "default"]


def adapter_bodies(n: int, seed: int) -> list[dict[str, object]]:
    """Chat bodies (short shared-prefix prompts) each naming an adapter of Zipf(0.8) popularity."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** 0.8 for rank in range(len(ADAPTERS))]
    bodies = rf.ChatWorkload(groups=8, prefix_words=40, max_tokens=16, seed=seed).bodies(n)
    for body in bodies:
        body["model"] = rng.choices(ADAPTERS, weights)[0]
    return bodies


def adapter_loads(urls: Sequence[str]) -> float:
    total = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=5).text
        total += sum(float(v) for v in re.findall(r"^kvfleet:lora_loads_total\{[^}]*\} (\S+)$", text, re.M))
    return total


def run_policy(policy: str, n: int, rate: float, warmup: int) -> tuple[object, float]:
    with (
        rf.engines(8, FLAGS, extra=LORA) as urls,
        rf.kvfleet_router(urls, ["--policy", policy], cpus="0") as router,
    ):
        bodies = adapter_bodies(warmup + n, seed=3)
        asyncio.run(rf.drive(router, bodies[:warmup], rate=rate, seed=1))
        before = adapter_loads(urls)
        records, duration = asyncio.run(rf.drive(router, bodies[warmup:], rate=rate, seed=2))
        loads_per_min = (adapter_loads(urls) - before) / duration * 60
    return rf.summary(records, duration), loads_per_min


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--warmup", type=int, default=40, help="requests sent first and not measured")
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    lines = [
        rf.header(
            f"LoRA routing: 8 engines x max 4 resident of 32 adapters (Zipf 0.8), 50 ms loads, "
            f"{args.requests} requests at {args.rate}/s"
        ),
        f"{'policy':<15}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'loads/min':>10}{'failed':>7}",
    ]
    results = {}
    for policy in args.policies.split(","):
        s, loads = run_policy(policy, args.requests, args.rate, args.warmup)
        results[policy] = (s, loads)
        label = "adapter-aware" if policy == "default" else policy  # default is adapter-aware for adapters
        lines.append(f"{label:<15}{rf.ms(s.ttft.p50 if s.ttft else None):>12}{rf.ms(s.ttft.p99 if s.ttft else None):>12}"
                     f"{loads:>10.1f}{s.num_failed:>7} {s.errors or ''}")  # fmt: skip
        print(lines[-1], flush=True)
    if {"least-request", "default"} <= set(results):
        (lr, lr_loads), (aa, aa_loads) = results["least-request"], results["default"]
        if lr.ttft and aa.ttft:
            lines.append(f"adapter-aware / least-request: TTFT p99 {aa.ttft.p99 / lr.ttft.p99:.2f}x, "
                         f"adapter loads/min {aa_loads / lr_loads if lr_loads else 0.0:.2f}x")  # fmt: skip
    publish(lines, "lora_routing.txt")


if __name__ == "__main__":
    main()
