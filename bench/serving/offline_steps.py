"""Where an offline ``LLM.generate`` spends its time, step by step: prefill vs decode, and how
fast each kind runs against the machine's matmul roof.

Where it sits: a profiling aid for issue #11 (``bench/peers/peers.py``'s offline part, same
workload: 32 random-token prompts of 64-512 tokens, 32-128 output tokens, EOS ignored, float32).
It wraps the engine's runner to time every step and prints, per kind of step (any prefill
rows / decode only), the steps, tokens, seconds and achieved GFLOP/s (matmul weights x 2 per
token, the LM head per sampled row, attention per query x key), then the biggest steps.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.serving.offline_steps [--model smollm2] [--budget 2048]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvfleet.bench import LoadSpec, parse_distribution
from kvfleet.bench.load import plan_requests
from kvfleet.engine import LLM, SamplingParams


@dataclass
class Step:
    seconds: float
    prefill_tokens: int
    decode_rows: int
    sampled: int
    attention_pairs: int  # query x key products


def timed_runner(llm: LLM, steps: list[Step]) -> None:
    runner = llm.engine.runner
    inner = runner.execute

    def execute(plan: Any) -> Any:
        start = time.perf_counter()
        out = inner(plan)
        seconds = time.perf_counter() - start
        prefill = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        decode = sum(1 for s in plan.scheduled if s.num_new_tokens == 1)
        pairs = sum(s.num_new_tokens * s.context_len for s in plan.scheduled)
        steps.append(Step(seconds, prefill, decode, len(out), pairs))
        return out

    runner.execute = execute


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", default="uniform:64:512")
    p.add_argument("--output-len", default="uniform:32:128")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args(argv)
    spec = LoadSpec(
        url="",
        num_requests=args.num_prompts,
        input_len=parse_distribution(args.input_len),
        output_len=parse_distribution(args.output_len),
    )
    requests = plan_requests(spec, random.Random(0))
    llm = LLM(model=args.model, dtype="float32", device="cpu", max_num_batched_tokens=args.budget)
    cfg = llm.engine.runner.model.config
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    llm.generate([requests[0].prompt], params[:1])  # warm-up
    steps: list[Step] = []
    timed_runner(llm, steps)
    start = time.perf_counter()
    llm.generate([r.prompt for r in requests], params)
    wall = time.perf_counter() - start
    layer_params = sum(p.numel() for n, p in llm.engine.runner.model.named_parameters() if ".layers." in n)
    head = cfg.vocab_size * cfg.hidden_size
    attn_flops_per_pair = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers

    def gflops(s: Step) -> float:
        tokens = s.prefill_tokens + s.decode_rows
        return 2 * layer_params * tokens + 2 * head * s.sampled + attn_flops_per_pair * s.attention_pairs

    print(
        f"{args.model}, {len(requests)} prompts, budget {args.budget}, torch threads {torch.get_num_threads()}: "
        f"{wall:.2f} s wall, {sum(s.seconds for s in steps):.2f} s in {len(steps)} runner steps"
    )
    print(f"{'kind':<22}{'steps':>6}{'tokens':>8}{'rows/step':>10}{'seconds':>9}{'ms/step':>9}{'GFLOP/s':>9}")
    for name, pick in (
        ("with prefill rows", lambda s: s.prefill_tokens > 0),
        ("decode only", lambda s: s.prefill_tokens == 0),
    ):
        chosen = [s for s in steps if pick(s)]
        if not chosen:
            continue
        secs = sum(s.seconds for s in chosen)
        tokens = sum(s.prefill_tokens + s.decode_rows for s in chosen)
        flops = sum(gflops(s) for s in chosen)
        print(
            f"{name:<22}{len(chosen):>6}{tokens:>8}{tokens / len(chosen):>10.1f}{secs:>9.2f}"
            f"{1000 * secs / len(chosen):>9.1f}{flops / secs / 1e9:>9.1f}"
        )
    decode = [s for s in steps if s.prefill_tokens == 0]
    by_rows: dict[int, list[float]] = {}
    for s in decode:
        by_rows.setdefault(s.decode_rows // 8 * 8, []).append(s.seconds)
    print("decode-only steps by rows (bucket of 8): rows, steps, ms/step, GFLOP/s")
    for rows in sorted(by_rows):
        secs = by_rows[rows]
        mean = sum(secs) / len(secs)
        rate = 2 * (layer_params + head) * (rows + 4) / mean / 1e9
        print(f"  {rows:>3}-{rows + 7:<3} {len(secs):>5} {1000 * mean:>8.1f} {rate:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
