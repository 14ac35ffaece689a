"""Every weight packer of ``engine/kernels/packing/`` (and the unpacked few-row kernel) on
SmolLM2's 30 layers of linears plus the LM head, weights streamed from memory as in a step.

    OMP_NUM_THREADS=2 python -m bench.kernels.packers_micro [--threads 2] [--reps 5] [--rows 1,4,8,16,32,64,256]

Where it sits: the micro-benchmark of ``packing/native.py`` (``csrc/packed_gemm.c``) against
``packing/mkl.py``, ``packing/onednn.py`` and ``csrc/skinny_gemm.c``, apart from their tests.
Each layer has its own random q/k/v (576 -> 960), o_proj (576 -> 576), gate/up (576 -> 3072)
and down_proj (1536 -> 576) weights, and the tied LM head is 576 -> 49152, so one pass
streams about 540 MB, like a decode step. For every row count the ways run interleaved,
``--reps`` times each; the median time of one pass and its GFLOP/s are printed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bench.common import bench_args
from bench.kernels.smollm2_linears import SHAPES as LAYER_SHAPES
from kvfleet.engine.kernels import packing
from kvfleet.engine.kernels.native.skinny_gemm import SKINNY_MAX_ROWS, load_linear

SHAPES = LAYER_SHAPES * 30 + [(576, 49152)]  # (in, out): 30 layers, then the tied LM head


def ways(
    weights: list[torch.Tensor], xs: dict[int, torch.Tensor], rows: int
) -> dict[str, Callable[[], None]]:
    found: dict[str, Callable[[], None]] = {}
    for name in packing.PACKERS:
        packed = [packing.pack_weight(w, name) for w in weights]
        if all(p is not None for p in packed):
            found[name] = lambda packed=packed: (
                [p(xs[p.in_features], None) for p in packed if p is not None] and None
            )
    skinny = load_linear()
    if skinny is not None and rows <= SKINNY_MAX_ROWS:
        found["few-row kernel"] = lambda: [skinny(xs[w.shape[1]], w, None) for w in weights] and None
    return found


def main() -> None:
    args = bench_args(__doc__, threads=2, reps=5, rows="1,4,8,16,32,64,256")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for k, n in SHAPES]
    flops_per_row = sum(2 * k * n for k, n in SHAPES)
    print(
        f"SmolLM2 linears x 30 layers + LM head, {args.threads} threads, median of {args.reps} interleaved passes"
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
            found = ways(weights, xs, rows)
            times: dict[str, list[float]] = {name: [] for name in found}
            for run in found.values():
                run()  # untimed: builds oneDNN's kernel for this row count
            for _ in range(args.reps):
                for name, run in found.items():
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
            cells = [
                f"{name} {1e3 * statistics.median(t):.1f} ms ({flops_per_row * rows / statistics.median(t) / 1e9:.0f} GFLOP/s)"
                for name, t in times.items()
            ]
            print(f"rows {rows:>4}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
