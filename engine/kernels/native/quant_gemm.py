"""The quantised matmul in C (``csrc/quant_gemm.c``): activations against weights kept in GGUF blocks.

Where it sits: a model served with ``--quantization gguf`` (``engine/model/quant_loader.py``)
keeps each linear's weight as the raw block bytes of the .gguf file, one row of blocks per
output row, and :mod:`kvfleet.engine.kernels.linear` resolves it to :class:`QuantLinear`,
which calls :func:`quant_linear` on every step. The kernel quantises the activations to int8
per 32 (llama.cpp's Q8_0 activations) and dots them with the weight's integers (AVX2 where the
build has it, the portable C path otherwise or when ``portable=True``: the tests compare both).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kvfleet.engine.kernels.native.build import library

# ggml type id -> (elements per block, bytes per block), the layouts of ggml-common.h
BLOCK_LAYOUTS: dict[int, tuple[int, int]] = {
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}
_ERRORS = {-1: "a type the kernel does not handle", -2: "k not a whole number of blocks", -3: "out of memory"}


class QuantKernelError(RuntimeError):
    """The kernel refused its operands (a type or a shape it does not take)."""


class NativeQuant:
    """``quant_linear`` behind a typed call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = lib.quant_linear
        self._fn.argtypes = [p, i64, i64, p, i64, i32, p, p, i32, i32]
        self._fn.restype = i32
        lib.quant_has_avx2.restype = i32
        self.has_avx2 = bool(lib.quant_has_avx2())

    def __call__(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        ggml_type: int,
        bias: torch.Tensor | None = None,
        portable: bool = False,
    ) -> torch.Tensor:
        """``x`` (m, k) float32 against ``blocks`` (n, row bytes) uint8 of ``ggml_type``: (m, n)."""
        x = x.contiguous()
        rows, k = x.shape
        n = blocks.shape[0]
        out = x.new_empty(rows, n)
        bias_ptr = None if bias is None else bias.data_ptr()
        rc = self._fn(
            x.data_ptr(),
            rows,
            k,
            blocks.data_ptr(),
            n,
            ggml_type,
            bias_ptr,
            out.data_ptr(),
            torch.get_num_threads(),
            int(portable),
        )
        if rc != 0:
            raise QuantKernelError(f"quant_linear (type {ggml_type}, k={k}): {_ERRORS.get(rc, rc)}")
        return out


@functools.cache
def load_quant() -> NativeQuant | None:
    """The native kernel, built on first use (None where the library does not build)."""
    lib = library()
    return None if lib is None else NativeQuant(lib)


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A linear's weight as GGUF blocks: ``blocks`` (out, row bytes) uint8, ``ggml_type`` its
    format, ``in_features`` the dequantised row length."""

    blocks: torch.Tensor
    ggml_type: int
    in_features: int

    def __post_init__(self) -> None:
        if self.ggml_type not in BLOCK_LAYOUTS:
            raise QuantKernelError(f"ggml type {self.ggml_type} has no quantised kernel")
        per_block, size = BLOCK_LAYOUTS[self.ggml_type]
        if self.in_features % per_block or self.blocks.shape[1] != self.in_features // per_block * size:
            raise QuantKernelError(
                f"rows of {self.blocks.shape[1]} bytes are not {self.in_features} values of type {self.ggml_type}"
            )
        if self.blocks.dtype != torch.uint8 or not self.blocks.is_contiguous():
            raise QuantKernelError("quantised blocks must be contiguous uint8")

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()
