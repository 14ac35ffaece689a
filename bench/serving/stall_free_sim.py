"""Stall-free batching on the simulated clock: the scheduler's trade-off without the machine's noise.

Where it sits: beside ``bench/serving/stall_free.py`` (the served run, which this box's neighbours
can make noise of); here the real ``Engine`` and scheduler run over ``engine/sim.py``'s
``SimRunner`` with a timing model fitted to SmolLM2 fp32 on this 2-core CPU (a step: 20 ms, plus
1.2 ms a batched token, 1 ms a sequence, 5 us a context token read), and a clock that only the steps advance.
Closed loop at each concurrency, prompts and outputs drawn as the served run draws them (``random``:
unrelated prompts; ``shared``: the first 80% of every prompt one prefix); per scheduler (today's,
``--no-stall-free``; stall-free with each ``--factors`` K; K with each ``--targets-ms`` floor): ITL
p50/p99, TTFT p99, output tokens/s, all in simulated time, so each row is exactly reproducible.

    .venv/bin/python -m bench.serving.stall_free_sim [--factors 2,2.5,3] [--targets-ms 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sim import SimRunner, TimingModel
from kvfleet.engine.tokenizer.byte_level import ByteTokenizer

# Fitted to SmolLM2 fp32 steps measured on this CPU, quiet: 1 decode row at 300 context 19 ms, 4 rows
# 28 ms, 1200 prompt tokens 1.44 s, 32 decode rows + a 32-token chunk at 4500 context 150 ms.
CPU_SMOLLM2 = TimingModel(base_s=0.020, per_token_s=0.0012, per_context_token_s=5e-6, per_row_s=0.001)


class Mode(NamedTuple):
    """One scheduler: today's (``factor`` None: ``--no-stall-free``), or stall-free with a factor and
    an optional target floor in ms."""

    factor: float | None
    target_ms: float | None = None

    @property
    def name(self) -> str:
        if self.factor is None:
            return "no stall-free (today)"
        floor = "" if self.target_ms is None else f", >= {self.target_ms:g} ms"
        return f"stall-free K={self.factor:g}{floor}"

    def config(self) -> dict[str, object]:
        if self.factor is None:
            return {"stall_free": False}
        return {"stall_free": True, "stall_free_factor": self.factor, "target_step_ms": self.target_ms}


def modes(factors: list[float], targets_ms: list[float]) -> list[Mode]:
    """Today's, each factor alone, the default factor with each target floor."""
    return [Mode(None), *(Mode(k) for k in factors), *(Mode(2.0, t) for t in targets_ms)]


@dataclass
class _Clock:
    now: float = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Req:
    arrival: float
    times: list[float] = field(default_factory=list)


def _prompts(workload: str, n: int, rng: random.Random) -> list[list[int]]:
    shared = [rng.randrange(1, 256) for _ in range(700)]
    out = []
    for _ in range(n):
        length = int(rng.uniform(64, 512) * 1.3)  # chat words to tokens, about as the served run
        own = [rng.randrange(1, 256) for _ in range(length)]
        out.append(shared[: int(0.8 * length)] + own[int(0.8 * length) :] if workload == "shared" else own)
    return out


def run_cell(workload: str, concurrency: int, mode: Mode, per_slot: int, seed: int) -> dict[str, float]:
    """One closed-loop cell; figures in simulated seconds."""
    rng = random.Random(seed + concurrency + (1 if workload == "shared" else 0))
    n = per_slot * concurrency
    prompts, outputs = _prompts(workload, n, rng), [rng.randint(32, 128) for _ in range(n)]
    clock = _Clock()
    cfg = EngineConfig(num_kv_blocks=8192, max_model_len=4096, device="cpu", **mode.config())  # type: ignore[arg-type]
    engine = Engine(cfg, runner=SimRunner(8192, CPU_SMOLLM2, sleep=clock.sleep), tokenizer=ByteTokenizer())
    reqs: dict[str, _Req] = {}
    nxt = 0

    def submit() -> None:
        nonlocal nxt
        rid = f"r{nxt}"
        engine.add_request(
            rid,
            prompts[nxt],
            SamplingParams(max_tokens=outputs[nxt], ignore_eos=True),
            arrival_time=clock.now,
        )
        reqs[rid], nxt = _Req(clock.now), nxt + 1

    for _ in range(concurrency):
        submit()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            reqs[delta.request_id].times.extend([clock.now] * sum(len(s.new_token_ids) for s in delta.seqs))
            if delta.finished and nxt < n:
                submit()
    itl = sorted(b - a for r in reqs.values() for a, b in zip(r.times, r.times[1:], strict=False))
    ttft = sorted(r.times[0] - r.arrival for r in reqs.values())
    return {
        "itl_p50": statistics.median(itl),
        "itl_p99": itl[int(0.99 * (len(itl) - 1))],
        "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))],
        "out_tps": sum(outputs) / clock.now,
    }


def table(schedulers: list[Mode], concurrency: list[int], per_slot: int, seed: int) -> list[str]:
    lines = [f"{'scheduler':<30} {'workload':<8} {'conc':>4} {'out tok/s':>9} {'TTFT p99 ms':>11} "
             f"{'ITL p50/p99 ms':>14} {'p99/p50':>7}"]  # fmt: skip
    for workload in ("random", "shared"):
        for c in concurrency:
            for mode in schedulers:
                r = run_cell(workload, c, mode, per_slot, seed)
                lines.append(f"{mode.name:<30} {workload:<8} {c:>4} {r['out_tps']:>9.1f} {r['ttft_p99'] * 1e3:>11.0f} "
                             f"{r['itl_p50'] * 1e3:>6.0f}/{r['itl_p99'] * 1e3:<7.0f} {r['itl_p99'] / r['itl_p50']:>7.1f}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--factors", default="2,2.5,3", help="stall-free factors K (the step bound: K x decodes)")
    p.add_argument("--targets-ms", default="300", help="target floors, each with K=2 (the default)")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--requests-per-slot", type=int, default=4, help="requests per cell = this x concurrency")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    schedulers = modes(floats(args.factors), floats(args.targets_ms))
    concurrency = [int(c) for c in args.concurrency.split(",")]
    print("\n".join(table(schedulers, concurrency, args.requests_per_slot, args.seed)))


def floats(csv: str) -> list[float]:
    return [float(x) for x in csv.split(",") if x]


if __name__ == "__main__":
    main()
