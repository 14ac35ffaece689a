"""The engine's own GEMM over weights packed once into column panels (``csrc/packed_gemm.c``),
behind typed calls: the third packed path of a float32 model on the CPU.

Where it sits: ``packing/native.py`` (the packer ``native``, beside ``mkl`` and ``onednn``;
``auto`` times them all at load and keeps the fastest) packs through :class:`PackedGemm` and
runs every row count of a linear through it: a decode step's few rows stream as fast as on
the unpacked few-row kernel (at 8 rows 28.5 against 36.8 ms a pass here).

Why: on an AMD EPYC (Zen 2, AVX2, 2 threads, FMA peak 215 GFLOP/s) oneDNN's packed GEMM ran
SmolLM2's 30 layers of linears plus the LM head, weights streamed from memory, at 101 GFLOP/s
for 32 rows, 122 for 64 and 144 for 256; this kernel ran 119, 152 and 169
(bench/kernels/packers_micro.py, bench/results/native_packed.txt). Each output is a float32 sum in
index order, so a row's result does not depend on the other rows of the batch (tested).
The packed copy replaces the library's: one more copy of the linears' weights, as before.
"""

from __future__ import annotations

import ctypes
import functools

from kvfleet.engine.kernels.native.build import bind

PANEL_COLUMNS = 16  # NR in csrc/packed_gemm.c: output columns per panel


class PackedGemm:
    """The three C entry points behind typed ctypes calls."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.size = lib.packed_size_f32
        self.size.argtypes, self.size.restype = [i64, i64], i64
        self.pack = lib.pack_weight_f32
        self.pack.argtypes, self.pack.restype = [p, i64, i64, p], None
        self.linear = lib.packed_linear_f32
        self.linear.argtypes, self.linear.restype = [p, i64, i64, p, i64, p, p, i32], None


@functools.cache
def load_packed_gemm() -> PackedGemm | None:
    """The three entry points, bound on first use (None where the library does not build)."""
    return bind(PackedGemm)
