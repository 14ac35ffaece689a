"""The native few-row matmul against torch's GEMM on a model's worth of layer weights.

    python -m bench.kernels.skinny_linear_micro [--threads 2] [--layers 30] [--rows 1,4,8,16,32]

Where it sits: beside ``engine/kernels/native/skinny_gemm.py`` (the test of its numbers is
tests/engine/kernels/test_linear.py; this only times it). SmolLM2's four matmul shapes
per layer (packed q/k/v, o_proj, packed gate/up, down_proj) for ``--layers`` layers of
distinct random weights, so each pass streams the weights from memory as a decode step
does. Prints ms per pass and the weight bandwidth reached: torch's ``F.linear`` on the
weights as stored (row-major), on column-major weights (the model's layout before the
native kernel), and the native kernel.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import bench_args
from bench.kernels.smollm2_linears import SHAPES, linear_pass
from kvfleet.engine.kernels.native.skinny_gemm import load_linear


def timed(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    args = bench_args(__doc__, threads=2, layers=30, rows="1,4,8,16,32", reps=5)
    torch.set_num_threads(args.threads)
    native = load_linear()
    if native is None:
        raise SystemExit("the native library did not build here (no C compiler?)")
    weights = [[torch.randn(n, k) for k, n in SHAPES] for _ in range(args.layers)]
    column_major = [[w.t().contiguous().t() for w in layer] for layer in weights]
    gigabytes = sum(k * n for k, n in SHAPES) * 4 * args.layers / 1e9
    print(
        f"# {args.layers} layers of SmolLM2 shapes, {gigabytes * 1e3:.0f} MB of weights, {args.threads} threads"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k, _ in SHAPES}

        def torch_pass(layers: list[list[torch.Tensor]], xs: dict[int, torch.Tensor] = xs) -> None:
            linear_pass(layers, xs, F.linear)

        def native_pass(xs: dict[int, torch.Tensor] = xs) -> None:
            linear_pass(weights, xs, native, None)

        with torch.inference_mode():
            results = {
                "torch row-major": timed(lambda: torch_pass(weights), args.reps),
                "torch column-major": timed(lambda: torch_pass(column_major), args.reps),
                "native": timed(native_pass, args.reps),
            }
        cells = "  ".join(
            f"{name} {ms:6.1f} ms {gigabytes / ms * 1e3:5.1f} GB/s" for name, ms in results.items()
        )
        print(f"rows {rows:3d}  {cells}", flush=True)


if __name__ == "__main__":
    main()
