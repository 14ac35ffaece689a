"""The native fused ops against their torch references, one call at a time (smollm2's widths).

    python -m bench.kernels.fused_ops_micro

Where it sits: a kernel-level check below ``bench/kernels/forward_ab.py``: residual add + RMSNorm
(hidden 576), SiLU * up (gate/up 2 x 1536) and in-place RoPE (15 q+k heads of 64) at 8 and
2048 rows, on 1 and 2 torch threads; the median wall and CPU microseconds of 50 calls each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvfleet.engine.kernels import fused_ops as f


def cases(k: f.NativeFused, rows: int) -> dict[str, Callable[[], object]]:
    x, r, w = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    gu = torch.randn(rows, 3072)
    qkv, cos, sin = torch.randn(rows, 960 + 384), torch.randn(rows, 64), torch.randn(rows, 64)
    qk = qkv[:, :960].unflatten(1, (15, 64))
    return {
        "add+norm torch": lambda: f.add_rms_norm_reference(x, r, w, 1e-5),
        "add+norm native": lambda: k.add_rms_norm(x, r, w, 1e-5),
        "silu*up torch": lambda: f.silu_mul_reference(gu),
        "silu*up native": lambda: k.silu_mul(gu),
        "rope torch": lambda: f.apply_rope_reference(qk, cos, sin),
        "rope native": lambda: k.rope_(qk, cos, sin),
    }


def main() -> None:
    k = f.load_fused()
    if k is None:
        raise SystemExit("the native ops did not build here (no C compiler?)")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in (8, 2048):
            for name, fn in cases(k, rows).items():
                walls, cpus = [], []
                for _ in range(50):
                    w0, c0 = time.perf_counter(), time.process_time()
                    fn()
                    walls.append(time.perf_counter() - w0)
                    cpus.append(time.process_time() - c0)
                wall, cpu = statistics.median(walls) * 1e6, statistics.median(cpus) * 1e6
                print(f"threads={threads} rows={rows:5} {name:16} wall {wall:9.1f} us  cpu {cpu:9.1f} us")


if __name__ == "__main__":
    main()
