"""Weights packed once for oneDNN's GEMM: a packed path of a float32 model on the CPU, and the bf16 one.

Where it sits: :mod:`kvfleet.engine.kernels.packing` picks, once per process, whether a
layer's linears are packed for MKL (:mod:`kvfleet.engine.kernels.packing.mkl`) or for
oneDNN (this module); ``kernels/linear.py`` then runs whichever ``PackedWeight``
the layer holds for steps of more than ``SKINNY_MAX_ROWS`` rows.

Why a second path: torch's MKL runs a generic AVX2 code path on AMD processors. On an
AMD EPYC (Zen, AVX2, 2 threads) SmolLM2's layer shapes ran at 95-130 GFLOP/s through
MKL and at 145-160 through oneDNN's JIT kernels over a weight reordered once
(``mkldnn._reorder_linear_weight``, the op torch's inductor uses when it freezes a model);
vLLM's CPU backend runs its linears on oneDNN too. The result equals ``F.linear``'s up to
float32 summation order (tested). oneDNN builds a kernel per new row count, about 1.4 ms
once, cached (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, default 1024 shapes).

bfloat16 (``--dtype bfloat16``): the same reorder and call take bf16 weights and rows, and oneDNN
runs them on AMX-BF16 or AVX512-BF16 (``brg_matmul:avx512_core_bf16`` on this EPYC; its verbose
log names the ISA). Only where ``cpu_features.choose_bf16`` finds one of them does the model prepack
bf16 weights (``packing.packs_model_dtype``); without them oneDNN emulates bf16 and ``F.linear`` runs.
"""

from __future__ import annotations

import functools

import torch

from kvfleet.engine.kernels.packing.base import PackedWeight


@functools.cache
def available() -> bool:
    """Whether this torch build runs oneDNN's packed linear (x86 and aarch64 builds with mkldnn)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((2, 8), 8.0)))


@functools.cache
def bf16_available() -> bool:
    """Whether this torch build's oneDNN runs the packed linear in bfloat16 on this CPU."""
    if not available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    ones = torch.ones(8, 8, dtype=torch.bfloat16)
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(ones, None)
        out = torch.ops.mkldnn._linear_pointwise(ones[:2], w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(out, torch.full((2, 8), 8.0, dtype=torch.bfloat16)))


class OnednnPackedWeight(PackedWeight):
    """A linear's (out, in) weight in oneDNN's blocked layout (an opaque mkldnn tensor); oneDNN's GEMM
    walks panels, so the few-row kernel streams a decode step faster (``streams_few_rows`` False)."""

    def __init__(
        self, packed: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(out_features, in_features, dtype)
        self.packed = packed

    @classmethod
    def available(cls) -> bool:
        return available()

    @classmethod
    def packs_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_available())

    @classmethod
    def from_matrix(cls, source: torch.Tensor) -> OnednnPackedWeight:
        n, k = source.shape
        return cls(torch.ops.mkldnn._reorder_linear_weight(source, None), n, k, source.dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
