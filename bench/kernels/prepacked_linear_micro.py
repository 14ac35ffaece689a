"""Linears packed once for MKL against ``F.linear`` (which packs per call), on SmolLM2's 30 layers.

    python -m bench.kernels.prepacked_linear_micro [--threads 2] [--reps 7] [--rows 17,64,256,476,1024,2048]

Where it sits: the micro-benchmark of ``engine/kernels/packing/mkl.py``, apart from its
test (tests/engine/kernels/test_packing_mkl.py). Each of 30 layers has its own random
q/k/v (576 -> 960), o_proj (576 -> 576), gate/up (576 -> 3072) and down_proj (1536 -> 576)
weights, so the weights stream from memory as in the model. For every row count the two
ways run interleaved, ``--reps`` times each; the medians and their ratio are printed,
then the resident memory the packing added.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import bench_args
from bench.kernels.smollm2_linears import SHAPES, linear_pass
from kvfleet.engine.kernels.packing.mkl import MklPackedWeight

LAYERS = 30


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def main() -> None:
    args = bench_args(__doc__, threads=2, reps=7, rows="17,64,256,476,1024,2048")
    torch.set_num_threads(args.threads)
    weights = [[torch.randn(n, k) * 0.05 for k, n in SHAPES] for _ in range(LAYERS)]
    before = resident_mb()
    packs: list[list[MklPackedWeight]] = []
    for layer in weights:
        row = [MklPackedWeight.pack(w) for w in layer]
        if any(p is None for p in row):
            raise SystemExit("this torch build has no MKL pack API")
        packs.append([p for p in row if p is not None])
    added = resident_mb() - before
    size = sum(w.numel() * 4 for layer in weights for w in layer) / 1e6
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# {LAYERS} layers of SmolLM2 linears, threads={args.threads}, reps={args.reps}, load {load}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in {k for k, _ in SHAPES}}

            def plain(xs: dict[int, torch.Tensor] = xs) -> None:
                linear_pass(weights, xs, F.linear)

            def packed(xs: dict[int, torch.Tensor] = xs) -> None:
                for layer in packs:
                    for pw in layer:
                        pw(xs[pw.in_features], None)

            times: dict[str, list[float]] = {"F.linear": [], "packed": []}
            plain(), packed()
            for _ in range(args.reps):
                for name, fn in (("F.linear", plain), ("packed", packed)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            base, mine = (statistics.median(times[n]) * 1e3 for n in ("F.linear", "packed"))
            print(
                f"rows {rows:5}  F.linear {base:8.1f} ms  packed {mine:8.1f} ms  ratio {mine / base:.3f}",
                flush=True,
            )
    print(f"weights {size:.0f} MB; resident memory added by packing {added:.0f} MB")


if __name__ == "__main__":
    main()
