"""The model's matmuls on the CPU: the native few-row kernel for decode steps, a packed GEMM otherwise.

Where it sits: every linear of the model (``engine/model/llama.py``: packed q/k/v, o_proj,
packed gate/up, down_proj, the LM head) calls :func:`linear`. A float32 CPU input of at
most ``SKINNY_MAX_ROWS`` rows (a decode step's batch) runs ``csrc/skinny_gemm.c``, which
streams the weight once, in memory order, with every weight vector used for all rows; a
prefill chunk, another dtype or device, or a machine where the native library does not
build, runs a GEMM library: over the weight packed once at load for MKL or oneDNN
(``packing.PackedWeight``, passed as ``packed``) where there is one, else ``F.linear``,
which packs it on every call. A weight packed for the native GEMM (``native_packed``) takes
every row count, decode steps included: its panels stream as fast from one row up.
The kernels read the weight as nn.Linear stores it, (out, in) row-major.

Measured on SmolLM2's layer shapes, 2 threads, weights streamed from memory (bench/
skinny_linear_micro.py, bench/results/skinny_linear.txt), per 30 layers: 8 rows 22.5 ms
against torch's 36.8; 16 rows 34.0 against 45.7; 1 row 17.7 both; 32 rows 58.5 against
56.8 (torch's GEMM is faster from there on, hence the threshold).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kvfleet.engine.kernels.cpu_decode import FLAGS, build_library
from kvfleet.engine.kernels.packing import PackedWeight

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
    lib = build_library(FLAGS).library
    return None if lib is None else NativeLinear(lib)


def skinny_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the native kernel takes this call: few float32 CPU rows, contiguous operands."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= SKINNY_MAX_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.is_contiguous()
        and weight.is_contiguous()
        and weight.shape[1] == x.shape[1]
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and not torch.is_grad_enabled()
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: through ``packed`` (``weight`` packed at load by a packer of
    ``packing.py``) when it takes ``x`` and streams a few rows as fast as the few-row kernel; else
    through that kernel when :func:`skinny_ok`; else through ``packed`` when it takes ``x``."""
    if packed is not None and packed.streams_few_rows and packed.takes(x):
        return packed(x, bias)
    if skinny_ok(x, weight, bias):
        native = load_linear()
        if native is not None:
            return native(x, weight, bias)
    if packed is not None and packed.takes(x):
        return packed(x, bias)
    return F.linear(x, weight, bias)
