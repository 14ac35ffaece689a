"""The few-row matmul in C (``csrc/skinny_gemm.c``): a decode step's rows against an unpacked weight.

Where it sits: :mod:`kvfleet.engine.kernels.linear` resolves each linear of the model to a
callable once at load; a float32 CPU input of at most :data:`SKINNY_MAX_ROWS` rows (a decode
step's batch) runs here, streaming the weight once, in memory order, with every weight vector
used for all rows. The kernel reads the weight as nn.Linear stores it, (out, in) row-major.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvfleet.engine.kernels.native.build import bind

SKINNY_MAX_ROWS = 16


class NativeLinear:
    """``skinny_linear_f32`` behind a typed call on contiguous float32 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = lib.skinny_linear_f32
        self._fn.argtypes = [p, i64, i64, p, i64, p, p, i32]
        self._fn.restype = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows, k = x.shape
        n = weight.shape[0]
        out = x.new_empty(rows, n)
        bias_ptr = None if bias is None else bias.data_ptr()
        self._fn(
            x.data_ptr(), rows, k, weight.data_ptr(), n, bias_ptr, out.data_ptr(), torch.get_num_threads()
        )
        return out


@functools.cache
def load_linear() -> NativeLinear | None:
    """The native kernel, built on first use (None where the library does not build: torch then)."""
    return bind(NativeLinear)
