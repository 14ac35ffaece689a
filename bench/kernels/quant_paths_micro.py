"""The GGUF kernel's paths against float32 ``F.linear`` on SmolLM2's layer shapes, by activation rows.

    python -m bench.kernels.quant_paths_micro [--threads 2] [--rows 1,4,8,17,64,256] [--reps 5]

Where it sits: beside ``engine/kernels/native/quant_gemm.py`` (its numbers are tested in
tests/engine/kernels/test_quant_gemm.py; this only times it). One layer's four matmuls (packed
q/k/v, o_proj, packed gate/up, down_proj) as Q4_1, each path of the kernel this build and CPU run
against float32 ``F.linear`` on weights of the same shapes; the sum over the shapes times 30
layers, best of ``--reps``. The float32 column is also the lower bound of the other prefill
design (dequantise a weight tile to float32, then a float GEMM): it cannot beat the GEMM alone.
Writes bench/results/quant_paths_micro.txt with the load average (a shared box: figures under load
are noise).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from bench.common import bench_args, call_seconds, publish
from kvfleet.engine.kernels.native.quant_gemm import QuantWeight, load_quant

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
LAYERS = 30


def best(fn: Callable[[], object], reps: int) -> float:
    return min(call_seconds(fn, reps)) * 1e3


def main() -> None:
    args = bench_args(__doc__, threads=2, rows="1,4,8,17,64,256", reps=5)
    torch.set_num_threads(args.threads)
    native = load_quant()
    if native is None:
        raise SystemExit("the native library does not build here")
    rng = np.random.default_rng(0)
    floats = [torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32) * 0.05) for n, k in SHAPES]
    q4_1 = int(GGMLQuantizationType.Q4_1)
    packed = [
        native.pack(QuantWeight(torch.from_numpy(quantize(w.numpy(), q4_1)), q4_1, w.shape[1]))
        for w in floats
    ]
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [f"{args.threads} threads, load average {load}; ms per {LAYERS} layers (best of {args.reps})"]
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, w.shape[1]) for w in floats]
        f32 = sum(best(lambda x=x, w=w: F.linear(x, w), args.reps) for x, w in zip(xs, floats, strict=True))
        row = [f"rows {m:3d}: float32 {f32 * LAYERS:8.2f}"]
        for path in native.paths[1:] or native.paths:  # the portable path only where it is alone
            took = sum(
                best(lambda x=x, p=p, path=path: native(x, p, path=path), args.reps)
                for x, p in zip(xs, packed, strict=True)
            )
            row.append(f"{path} {took * LAYERS:8.2f} ({f32 / took:.2f}x)")
        lines.append("  ".join(row))
    lines.append("load average after: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    publish(lines, "quant_paths_micro.txt")


if __name__ == "__main__":
    main()
