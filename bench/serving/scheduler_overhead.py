"""Scheduler + KV block manager overhead per engine step at 256 running sequences (target <= 1 ms).

A null runner (it samples token 0 for every sequence, instantly) isolates the CPU work of
one step: ``Scheduler.schedule()`` + ``Scheduler.update()`` (block allocation, prefix-cache
registration of newly full blocks), and, separately, the whole ``Engine.step()`` with
output processing (stop checks, detokenisation), once with per-step outputs (what a
streaming server asks for) and once with ``RequestOutputKind.FINAL_ONLY`` (what
``LLM.generate`` asks for: a request's output is built only when it finishes). Prompts have mixed lengths so block
boundaries are crossed on different steps, as in real decoding.

    .venv/bin/python -m bench.serving.scheduler_overhead [--seqs 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.kv.kv_cache_manager import KVCacheManager
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sampling_params import RequestOutputKind, SamplingParams
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.sched.scheduler import Scheduler
from kvfleet.engine.sequence import Sequence as Seq

TARGET_US = 1000.0


class NullRunner:
    """Costs nothing per step: the same precomputed sample for every sequence it has seen."""

    def __init__(self, num_kv_blocks: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.samples: dict[int, SampleResult] = {}

    def execute(self, plan: SchedulerPlan) -> dict[int, SampleResult]:
        if len(self.samples) < len(plan.scheduled):
            for e in plan.scheduled:
                self.samples.setdefault(e.seq.seq_id, SampleResult(1 + e.seq.seq_id % 200))
        return self.samples


class ByteTokenizer:
    eos_token_ids = frozenset({256})
    vocab_size = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return ""


class AsciiDetokenizer:
    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.tokenizer = tokenizer

    def push(self, token_ids: list[int]) -> str:
        return b"".join(self.tokenizer.token_bytes(t) for t in token_ids).decode("latin-1")


def prompts(n: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(1, 250) for _ in range(rng.randrange(16, 512))] for _ in range(n)]


def bench_scheduler(num_seqs: int, steps: int, caching: bool, rng: random.Random) -> float:
    kv = KVCacheManager(num_blocks=num_seqs * 64, block_size=16, enable_prefix_caching=caching)
    sched = Scheduler(kv, max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20)
    params = SamplingParams(max_tokens=1 << 16)
    for p in prompts(num_seqs, rng):
        sched.add(Seq("r", p, params))
    runner = NullRunner(kv.num_blocks)
    sched.update(plan := sched.schedule(), runner.execute(plan))  # the prefill step
    assert sched.num_running == num_seqs
    start = time.perf_counter()
    for _ in range(steps):
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
    return (time.perf_counter() - start) / steps * 1e6


def bench_engine(num_seqs: int, steps: int, kind: RequestOutputKind, rng: random.Random) -> float:
    config = EngineConfig(
        block_size=16, max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20, max_model_len=1 << 14
    )
    engine = Engine(config, NullRunner(num_seqs * 64), ByteTokenizer(), detokenizer_factory=AsciiDetokenizer)
    params = SamplingParams(max_tokens=1 << 13, stop=["\x00\x00"], ignore_eos=True, output_kind=kind)
    for i, p in enumerate(prompts(num_seqs, rng)):
        engine.add_request(f"r{i}", p, params)
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e6


class _Probe:
    def __init__(self) -> None:
        self.a, self.b = [0] * 100, [0] * 10

    @property
    def n(self) -> int:
        return len(self.a) + len(self.b)


def calibrate(num: int) -> float:
    """µs for ``num`` property reads: how fast this machine runs Python, to scale the figures."""
    probes = [_Probe() for _ in range(num)]
    start = time.perf_counter()
    for _ in range(200):
        for p in probes:
            _ = p.n
    return (time.perf_counter() - start) / 200 * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = [
        ("schedule()+update(), prefix caching on", bench_scheduler(args.seqs, args.steps, True, rng)),
        ("schedule()+update(), prefix caching off", bench_scheduler(args.seqs, args.steps, False, rng)),
        (
            "Engine.step(), per-step outputs",
            bench_engine(args.seqs, args.steps, RequestOutputKind.PER_STEP, random.Random(1)),
        ),
        (
            "Engine.step(), FINAL_ONLY outputs",
            bench_engine(args.seqs, args.steps, RequestOutputKind.FINAL_ONLY, random.Random(1)),
        ),
    ]
    print(
        f"scheduler overhead per decode step, {args.seqs} running sequences, {args.steps} steps, block size 16"
    )
    print(
        f"  (machine speed: {calibrate(args.seqs):.1f} us for {args.seqs} Python property reads; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    for name, us in rows:
        print(
            f"  {name:<42} {us:9.1f} us/step  {us / args.seqs:6.2f} us/seq  {us / TARGET_US:5.2f}x of the 1 ms target"
        )


if __name__ == "__main__":
    main()
