"""Per-forward cost of the model on its own: prefill waves and decode batches, wall and CPU time.

    python -m bench.kernels.forward_ab [--model smollm2] [--threads 2] [--reps 15] [--cases prefill2048,decode8]
    python -m bench.kernels.forward_ab --generate 8 [--threads 2]   # LLM.generate end to end instead

Where it sits: below the engine (no scheduler, no sampler): it loads the model with the
runner, fills a paged KV cache with synthetic block tables, and times
``LlamaForCausalLM.forward`` for a few fixed shapes of step. The figures are medians of
``--reps`` forwards after a warm-up: wall time, and process CPU time (both threads'
cycles: on a shared box the CPU time moves less with the neighbours' load than the wall
time does). Run it on two commits (or with ``KVFLEET_FUSED_KERNELS=0`` against the
default) interleaved, and compare medians; the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import NamedTuple

import torch

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.runner.model_runner import ModelRunner

BLOCK = 16


class Case(NamedTuple):
    """``num_seqs`` sequences, each with ``new`` tokens this step on top of ``cached`` in the cache."""

    num_seqs: int
    new: int
    cached: int


CASES = {
    "prefill512": Case(1, 512, 0),
    "prefill2048": Case(4, 512, 0),
    "prompt492": Case(
        1, 460, 32
    ),  # the longest chat prompt of bench/peers/peers.py's c=1 cell, template block cached
    "fresh6x352": Case(6, 352, 0),  # six prompts from token 0
    "cached6x320": Case(6, 320, 32),  # the same rows behind a cached 32-token system prompt
    "suffix8x64": Case(8, 64, 256),
    "suffix1x8": Case(
        1, 8, 32
    ),  # a short chat turn behind the cached system prompt  # short suffixes after a long cached shared prefix
    "decode1": Case(1, 1, 300),
    "decode8": Case(8, 1, 300),
    "decode32": Case(32, 1, 300),
}


def metadata(case: Case) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Input ids, positions, attention metadata and sample rows of one step of ``case``."""
    blocks_per_seq = -(-(case.new + case.cached) // BLOCK)
    ids, positions, slots, starts, tables = [], [], [], [0], []
    for s in range(case.num_seqs):
        table = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        tables.append(table)
        for p in range(case.cached, case.cached + case.new):
            ids.append((s * 7919 + p * 31) % 40000 + 100)
            positions.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        starts.append(starts[-1] + case.new)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor([case.cached + case.new] * case.num_seqs, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=case.new,
        max_seq_len=case.cached + case.new,
    )
    sample_rows = torch.tensor(starts[1:]) - 1
    return torch.tensor(ids), torch.tensor(positions), meta, sample_rows


def time_case(runner: ModelRunner, case: Case, reps: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of one forward of ``case``."""
    ids, positions, meta, sample_rows = metadata(case)
    walls, cpus = [], []
    with torch.inference_mode():
        for i in range(reps + 2):
            w0, c0 = time.perf_counter(), time.process_time()
            runner.model(ids, positions, runner.kv_caches, meta, runner.backend, sample_rows)
            if i >= 2:  # two warm-ups
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
    return statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3


def generate(model: str, num_prompts: int, label: str, threads: int) -> None:
    """Output tokens/s of one ``LLM.generate`` over ``num_prompts`` fixed random prompts."""
    from kvfleet.engine import LLM, SamplingParams

    rng = random.Random(0)
    llm = LLM(model=str(resolve_model(model)))
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(64, 512))] for _ in range(num_prompts)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(32, 128), ignore_eos=True) for _ in prompts
    ]
    w0, c0 = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{label:10} generate{num_prompts:<4} threads={threads} wall {wall:7.2f} s  cpu {cpu:7.2f} s  "
        f"{tokens / wall:6.1f} out tok/s (wall)  {tokens / cpu:6.1f} out tok/cpu-s  load {load}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--label", default="")
    p.add_argument("--generate", type=int, default=0, help="time LLM.generate over N prompts instead")
    p.add_argument("--no-prepack-weights", action="store_true", help="F.linear packs the weights per call")
    p.add_argument("--weight-packing", default="auto", choices=["auto", "mkl", "onednn"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.generate:
        generate(args.model, args.generate, args.label, args.threads)
        return
    cases = [CASES[name] for name in args.cases.split(",")]
    blocks = max(c.num_seqs * -(-(c.new + c.cached) // BLOCK) for c in cases)
    config = EngineConfig(
        model=str(resolve_model(args.model)),
        num_kv_blocks=blocks,
        block_size=BLOCK,
        prepack_weights=not args.no_prepack_weights,
        weight_packing=args.weight_packing,
    )
    runner = ModelRunner(config, config.model)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for name in args.cases.split(","):
        wall, cpu = time_case(runner, CASES[name], args.reps)
        tokens = CASES[name].num_seqs * CASES[name].new
        print(
            f"{args.label:10} {name:12} threads={args.threads} wall {wall:8.2f} ms  cpu {cpu:8.2f} ms  "
            f"{tokens / wall * 1e3:9.1f} tok/s  load {load}",
            flush=True,
        )


if __name__ == "__main__":
    main()
