"""A decode step's time with all layers in one native call against the per-op path, same run.

    OMP_NUM_THREADS=2 python -m bench.kernels.decode_step [--model smollm2] [--rows 1,8,32] [--steps 40]
        [--dtypes float32,bfloat16]

For each batch size: that many requests of a ~240-token prompt are prefilled, then
``engine.step()`` is timed over decode steps with ``LlamaForCausalLM.use_fused_decode`` on
and off, alternating in rounds on the same engine (same weights, same caches), and the
medians are printed with their ratio. The runner's forward alone is timed the same way. Each of
``--dtypes`` gets its own engine (``bfloat16`` on the CPU: bf16 weights on the native bf16 kernel,
``layers/linear/bf16.py``), with the load average beside each line (a loaded box's figures are noisy).
"""

from __future__ import annotations

import gc
import os
import statistics
import time

from bench.common import Flag, bench_args
from kvfleet.engine.client.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams

PROMPT = "Tell me a long story about a dragon and a knight. " * 20


def timed_steps(llm: LLM, steps: int) -> tuple[list[float], list[float]]:
    engine, model = llm.engine, llm.engine.runner.model
    forward = model.forward  # what every path calls, the eager one and the decode path's buffers alike
    fwd: list[float] = []

    def timed_forward(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        fwd.append(time.perf_counter() - start)
        return out

    model.forward = timed_forward  # type: ignore[method-assign]
    walls = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
    finally:
        del model.forward  # the class's method again
    return walls, fwd


def measure(model: str, rows: int, steps: int, rounds: int, dtype: str = "float32") -> str:
    llm = LLM(model, max_model_len=2048, dtype=dtype)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(rows):
        llm.engine.add_request(f"r{i}", PROMPT + str(i), params)
    scheduler = llm.engine.scheduler
    while scheduler.waiting or any(not s.output_token_ids for s in scheduler.running):
        llm.engine.step()  # the prompts
    for _ in range(3):
        llm.engine.step()
    results: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
    for _ in range(rounds):
        for fused in (True, False):
            llm.engine.runner.model.use_fused_decode = fused
            walls, fwd = timed_steps(llm, steps // rounds)
            results[fused][0].extend(walls)
            results[fused][1].extend(fwd)
    del llm
    gc.collect()  # the next batch size's engine must not share the box with this one's memory
    (on_w, on_f), (off_w, off_f) = results[True], results[False]
    med = statistics.median
    return (
        f"{dtype:8s} {rows:4d} rows  engine.step per-op {med(off_w) * 1e3:6.1f} ms  one call {med(on_w) * 1e3:6.1f} ms "
        f"({med(off_w) / med(on_w):.2f}x)   forward per-op {med(off_f) * 1e3:6.1f}  one call "
        f"{med(on_f) * 1e3:6.1f} ({med(off_f) / med(on_f):.2f}x)  load {os.getloadavg()[0]:.2f}"
    )


def main() -> None:
    args = bench_args(
        __doc__,
        model="smollm2",
        rows="1,8,32",
        steps=Flag(40, "timed decode steps per mode"),
        rounds=Flag(4, "on/off alternations"),
        dtypes=Flag("float32", "comma-separated --dtype values, one engine each"),
    )
    for rows in (int(r) for r in args.rows.split(",")):
        for dtype in args.dtypes.split(","):
            print(measure(args.model, rows, args.steps, args.rounds, dtype), flush=True)


if __name__ == "__main__":
    main()
