"""Tensor parallelism on this machine: SmolLM2 at tp=2 against tp=1, decode step time, offline
throughput, and what the all-reduces cost per step (gloo on the CPU).

Where it sits: the figures behind docs/architecture.md's tensor-parallelism paragraph (issue #29).
Each run builds ``LLM("smollm2", tensor_parallel_size=tp)`` (tp=2: rank 0 in this process, one
worker process, each torch with half the cores), times every runner step (the wall time of
``ModelRunner.execute``: the forward, the collectives and sampling), and on rank 0 the wall time
spent inside ``all_reduce`` (the waiting for the other rank included). Bounded to a few minutes.

    .venv/bin/python -m bench.serving.tensor_parallel [--rows 8] [--new-tokens 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import RESULTS, cpu_name
from kvfleet.engine import LLM, SamplingParams


def run(tp: int, rows: int, new_tokens: int) -> dict[str, Any]:
    llm = LLM("smollm2", tensor_parallel_size=tp, max_num_seqs=rows)
    runner: Any = llm.engine.runner
    steps: list[tuple[float, int, float, int]] = []  # seconds, decode rows, all-reduce s, all-reduces
    inner = runner.execute

    def execute(plan: Any) -> Any:
        comm = runner.tp_comm
        before = (comm.reduce_seconds, comm.reduces) if comm is not None else (0.0, 0)
        start = time.perf_counter()
        out = inner(plan)
        seconds = time.perf_counter() - start
        decode = all(s.num_new_tokens == 1 for s in plan.scheduled)
        after = (comm.reduce_seconds, comm.reduces) if comm is not None else (0.0, 0)
        steps.append(
            (seconds, len(plan.scheduled) if decode else 0, after[0] - before[0], after[1] - before[1])
        )
        return out

    runner.execute = execute
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(rows)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    steps.clear()
    start = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - start
    full = [s for s in steps if s[1] == rows]
    llm.close()
    return {
        "tp": tp,
        "decode_ms": 1000 * statistics.median(s[0] for s in full),
        "reduce_ms": 1000 * statistics.median(s[2] for s in full),
        "reduces": statistics.median(s[3] for s in full),
        "tokens_per_s": rows * new_tokens / wall,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "tensor_parallel.txt")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    lines = [
        f"tensor parallelism, SmolLM2-135M float32, {cpu_name()}, {threads} torch threads in all "
        f"(tp=2: {max(1, threads // 2)} per rank), gloo over localhost",
        f"offline: {args.rows} prompts of 64 random tokens, {args.new_tokens} new tokens each, greedy",
        "tp  decode step (ms, median, all rows)  all-reduce on rank 0 (ms/step, count)  offline tokens/s",
    ]
    for tp in (1, 2):
        r = run(tp, args.rows, args.new_tokens)
        lines.append(
            f"{r['tp']:<3} {r['decode_ms']:>8.1f} {'':26} {r['reduce_ms']:>6.2f} ({r['reduces']:.0f}) {'':22} "
            f"{r['tokens_per_s']:>7.1f}"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
