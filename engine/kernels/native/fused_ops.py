"""The decoder's fused element-wise ops in C (``csrc/fused_ops.c``): RMSNorm with the residual add,
RoPE in place, SiLU(gate) * up, behind typed calls.

Where it sits: :mod:`kvfleet.engine.kernels.fused_ops` sends float32 CPU tensors here (CUDA ones to
the Triton ops, anything else to the torch references).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvfleet.engine.kernels.native.build import bind


class NativeFused:
    """``add_rms_norm_f32`` and ``silu_mul_f32`` behind typed calls on contiguous float32 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._norm = lib.add_rms_norm_f32
        self._norm.argtypes = [p, p, p, p, i64, i64, f32, i32]
        self._norm.restype = None
        self._silu = lib.silu_mul_f32
        self._silu.argtypes = [p, p, i64, i64, i32]
        self._silu.restype = None
        self._rope = lib.rope_f32
        self._rope.argtypes = [p, p, p, i64, i64, i32, i32, i32]
        self._rope.restype = None

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += x`` in place (x may be None), and the normalised rows as a new tensor."""
        rows, n = residual.shape
        out = torch.empty_like(residual)
        x_ptr = None if x is None else x.data_ptr()
        threads = torch.get_num_threads()
        self._norm(x_ptr, residual.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, n, eps, threads)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, m = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, m)
        self._silu(gate_up.data_ptr(), out.data_ptr(), rows, m, torch.get_num_threads())
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (T, heads, D; heads and D packed, rows at any stride) in place."""
        rows, heads, dim = x.shape
        self._rope(
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            rows,
            x.stride(0),
            heads,
            dim,
            torch.get_num_threads(),
        )
        return x


@functools.cache
def load_fused() -> NativeFused | None:
    """The native ops, built on first use (None where the library does not build: torch then)."""
    return bind(NativeFused)
