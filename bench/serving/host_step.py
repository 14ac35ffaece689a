"""The host's work per engine step with a real runner: where a small model's GPU step waits on Python.

Where it sits: beside ``scheduler_overhead.py`` (Scheduler + Engine.step with a null runner), this
bench builds the real engine on the ``tiny`` checkpoint and times each phase of ``Engine.step()``:
``Scheduler.schedule()``, the runner's input preparation (``StepBuffers.fill`` on the decode path,
``StepBuffers.fill_plan`` on a mixed step), the forward, the sampler, ``Scheduler.update()`` and output
processing (stop checks, detokenisation, deltas). With ``--null-forward`` the forward is replaced by
a precomputed logits tensor, so the step is all host work: what an H100 would wait on for a 135M
model (issue #30: the GPU busy 22% of a SmolLM2 offline run). Two workloads: ``decode`` (every
sequence decoding, the decode path) and ``mixed`` (a new request admitted each step as one finishes:
the unpadded ``fill_plan`` path). ``--profile`` prints cProfile's top functions; ``--async-scheduling``
runs the engine with it (on the CPU nothing overlaps: this shows what the mode itself costs the host).

    .venv/bin/python -m bench.serving.host_step [--seqs 64 256] [--steps 100] [--null-forward] [--final-only]
        [--async-scheduling] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.sampling_params import RequestOutputKind, SamplingParams

PHASES = ("schedule", "prepare", "forward", "sample", "update", "total")


class Clock:
    """Accumulated seconds per phase, by wrapping methods of the engine's parts."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(obj, attr, timed)


def build(num_seqs: int, workload: str, null_forward: bool, kind: RequestOutputKind, overlap: bool) -> Engine:
    config = EngineConfig(
        model="tiny",
        max_num_seqs=num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        seed=0,
        async_scheduling=overlap,
    )
    engine = Engine(config)
    rng = random.Random(0)
    for i in range(num_seqs):
        max_tokens = 1500 if workload == "decode" else rng.randrange(20, 400)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=kind)
        engine.add_request(f"r{i}", [rng.randrange(0, 256) for _ in range(rng.randrange(8, 200))], params)
    while engine.scheduler.num_waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    if null_forward:
        _null_forward(engine)
    gc.collect()
    gc.freeze()  # as the engine core does once it is built (engine/core/loop.py)
    return engine


def _null_forward(engine: Engine) -> None:
    """Replace the model's forward by fixed logits (a distinct argmax per row): no device work left."""
    runner: Any = engine.runner
    vocab = runner.model_config.vocab_size
    logits = torch.randn(8192, vocab, generator=torch.Generator().manual_seed(0))
    if runner.decode is not None:
        runner.decode.graphs.run = lambda shape: logits[: shape.rows]
    runner._forward = lambda batch, native: logits[: batch.sample_rows.shape[0]]


def instrument(engine: Engine) -> Clock:
    clock = Clock()
    runner: Any = engine.runner
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "update", "update")
    clock.wrap(engine, "step", "total")
    clock.wrap(runner.inputs, "fill", "prepare")  # the one step buffers: padded decode steps
    clock.wrap(runner.inputs, "fill_plan", "prepare")  # and every other step
    if runner.decode is not None:
        clock.wrap(runner.decode.graphs, "run", "forward")
    clock.wrap(runner, "_forward", "forward")
    clock.wrap(runner, "_pick", "sample")
    clock.wrap(runner.sampler, "read", "sample")
    return clock


def _new_request(engine: Engine, rng: random.Random, i: int, kind: RequestOutputKind) -> None:
    params = SamplingParams(
        max_tokens=rng.randrange(20, 400), ignore_eos=True, temperature=0.0, output_kind=kind
    )
    engine.add_request(f"n{i}", [rng.randrange(0, 256) for _ in range(rng.randrange(8, 200))], params)


def run(num_seqs: int, steps: int, workload: str, null_forward: bool, kind: RequestOutputKind,
        profile: bool, overlap: bool) -> dict[str, float]:  # fmt: skip
    engine = build(num_seqs, workload, null_forward, kind, overlap)
    clock = instrument(engine)
    rng = random.Random(1)
    prof = cProfile.Profile() if profile else None
    added = 0
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        while workload == "mixed" and engine.scheduler.num_running + engine.scheduler.num_waiting < num_seqs:
            _new_request(engine, rng, added, kind)
            added += 1
        engine.step()
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats(os.environ.get("PSORT", "tottime")).print_stats(22)
    ms = {p: clock.seconds[p] / steps * 1e3 for p in PHASES}
    ms["output"] = ms["total"] - sum(ms[p] for p in PHASES[:-1])
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--workload", choices=("decode", "mixed"), nargs="+", default=["decode", "mixed"])
    ap.add_argument("--null-forward", action="store_true")
    ap.add_argument("--final-only", action="store_true", help="LLM.generate's outputs (default: per step)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true", help="the engine's --async-scheduling")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kind = RequestOutputKind.FINAL_ONLY if args.final_only else RequestOutputKind.PER_STEP
    forward = "null forward" if args.null_forward else "tiny forward"
    forward += ", async scheduling" if args.async_scheduling else ""
    print(f"host ms per engine step, tiny checkpoint, {forward}, {kind.name} outputs, {args.steps} steps, "
          f"1 torch thread; load {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")  # fmt: skip
    cols = ("schedule", "prepare", "forward", "sample", "update", "output", "total")
    print(f"  {'workload':<8} {'seqs':>5} " + " ".join(f"{c:>9}" for c in cols) + "   host (total - forward)")
    for workload in args.workload:
        for n in args.seqs:
            ms = run(n, args.steps, workload, args.null_forward, kind, args.profile, args.async_scheduling)
            host = ms["total"] - ms["forward"]
            print(f"  {workload:<8} {n:>5} " + " ".join(f"{ms[c]:9.3f}" for c in cols) + f"   {host:9.3f}")


if __name__ == "__main__":
    main()
