"""The bf16-weight kernel's paths against the float32 few-row kernel and torch's bf16 F.linear.

    python -m bench.kernels.bf16_decode_micro [--threads 2] [--layers 6] [--rows 1,8,32,64] [--reps 5]

Where it sits: beside ``engine/kernels/native/bf16_gemm.py`` (its numbers are tested in
tests/engine/kernels/test_bf16_gemm.py; this only times them). For each row count: SmolLM2's four
layer matmul shapes (packed q/k/v, o, packed gate/up, down) over ``--layers`` layers of distinct
random weights, so a pass streams them from memory as a decode step does, and the LM head
(49152 x 576) on its own. Columns: the native bf16 kernel on each path this build and CPU run
(``amx``, ``avx512_bf16``, ``portable``), the float32 few-row kernel (``skinny_gemm.c``, any rows
here) and torch's ``F.linear`` on bf16 input and weights (oneDNN). ms per pass, median of
``--reps``. The load average is printed first: a loaded box's figures are noise-prone.
"""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import bench_args, call_seconds
from bench.kernels.smollm2_linears import SHAPES
from kvfleet.engine.kernels.native.bf16_gemm import NativeBf16, load_bf16, pack_panels
from kvfleet.engine.kernels.native.skinny_gemm import NativeLinear, load_linear

HEAD = (576, 49152)  # (in, out) of SmolLM2's LM head


def timed(fn: Callable[[], object], reps: int) -> float:
    return statistics.median(call_seconds(fn, reps)) * 1e3


def runs_for(
    bf16: NativeBf16, skinny: NativeLinear, f32: list[torch.Tensor], rows: int
) -> dict[str, Callable[[], object]]:
    """One pass over ``f32``'s weights at ``rows`` rows for each kernel timed."""
    panels = [pack_panels(w) for w in f32]
    dense = [w.bfloat16() for w in f32]
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in f32}
    xb = {k: x.bfloat16() for k, x in xs.items()}
    runs: dict[str, Callable[[], object]] = {}
    for path in bf16.paths:
        runs[f"bf16 {path}"] = functools.partial(
            lambda p: [bf16(xs[w.in_features], w, None, p) for w in panels], path
        )
    runs["f32 skinny"] = lambda: [skinny(xs[w.shape[1]], w, None) for w in f32]
    runs["torch bf16"] = lambda: [F.linear(xb[w.shape[1]], w) for w in dense]
    return runs


def main() -> None:
    args = bench_args(__doc__, threads=2, layers=6, rows="1,8,32,64", reps=5)
    torch.set_num_threads(args.threads)
    bf16, skinny = load_bf16(), load_linear()
    if bf16 is None or skinny is None:
        raise SystemExit("the native library did not build here (no C compiler?)")
    print(
        f"# load average {os.getloadavg()}; {args.threads} threads; bf16 paths {bf16.paths}, best {bf16.path}"
    )
    groups = {"layers": [(k, n) for _ in range(args.layers) for k, n in SHAPES], "lm head": [HEAD]}
    for label, shapes in groups.items():
        f32 = [torch.randn(n, k) * 0.05 for k, n in shapes]
        print(f"## {label}: {sum(w.numel() for w in f32) * 2 / 1e6:.0f} MB of bf16 weights")
        for rows in (int(r) for r in args.rows.split(",")):
            runs = runs_for(bf16, skinny, f32, rows)
            with torch.inference_mode():
                cells = "  ".join(f"{name} {timed(fn, args.reps):7.2f}" for name, fn in runs.items())
            print(f"rows {rows:3d}  {cells}  (ms)  load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
