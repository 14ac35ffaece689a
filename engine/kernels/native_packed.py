"""Weights packed once into column panels for the engine's own GEMM (``csrc/packed_gemm.c``): the
third packed path of a float32 model on the CPU.

Where it sits: :mod:`kvfleet.engine.kernels.packing` registers it as the packer ``native``
beside ``mkl`` and ``onednn``; ``auto`` times them all at load and keeps the fastest. A layer
then holds a :class:`PackedWeight` beside each linear, and ``cpu_linear.linear`` calls it for
steps of more than ``SKINNY_MAX_ROWS`` rows (decode batches past 16 rows, prefill chunks);
fewer rows stay on the unpacked few-row kernel (at 8 rows 28.5 against 36.8 ms a pass here).

Why: on an AMD EPYC (Zen 2, AVX2, 2 threads, FMA peak 215 GFLOP/s) oneDNN's packed GEMM ran
SmolLM2's 30 layers of linears plus the LM head, weights streamed from memory, at 101 GFLOP/s
for 32 rows, 122 for 64 and 144 for 256; this kernel ran 119, 152 and 169
(bench/packers_micro.py, bench/results/native_packed.txt). Each output is a float32 sum in
index order, so a row's result does not depend on the other rows of the batch (tested).
The packed copy replaces the library's: one more copy of the linears' weights, as before.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from kvfleet.engine.kernels.cpu_decode import FLAGS, build_library
from kvfleet.engine.kernels.mkl_packed import packable_input

PANEL_COLUMNS = 16  # NR in csrc/packed_gemm.c: output columns per panel


class _Native:
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
def _native() -> _Native | None:
    lib = build_library(FLAGS).library
    return None if lib is None else _Native(lib)


def available() -> bool:
    """Whether the native library builds here (a C compiler and OpenMP)."""
    return _native() is not None


class PackedWeight(NamedTuple):
    """A linear's (out, in) weight as panels of :data:`PANEL_COLUMNS` output columns, k-major."""

    panels: torch.Tensor  # float32, (ceil(out / 16) * 16 * in,)
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for a contiguous float32 (rows, in) ``x``."""
        native = _native()
        assert native is not None  # a PackedWeight exists only where the library built
        rows, n, k = x.shape[0], self.out_features, self.in_features
        out = x.new_empty(rows, n)
        b = None if bias is None else bias.to(torch.float32).contiguous()
        native.linear(
            x.data_ptr(), rows, k, self.panels.data_ptr(), n, None if b is None else b.data_ptr(),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    @property
    def streams_few_rows(self) -> bool:
        """One row streams each panel at the memory's pace (prefetched 1 KB ahead): SmolLM2's 121
        matmuls a pass against the few-row kernel, 2 threads: 1-6 rows 18-21 against 19-24 ms, 8
        rows level (27-28), 12-16 rows 30-39 against 37-50."""
        return True

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can run through this packed weight."""
        return packable_input(x, self.in_features)


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` (out, in) packed into panels, or None (not a float32 CPU matrix, or no library)."""
    native = _native()
    if native is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    source = weight.detach().contiguous()
    panels = torch.empty(native.size(n, k), dtype=torch.float32)
    native.pack(source.data_ptr(), n, k, panels.data_ptr())
    return PackedWeight(panels, n, k)
