"""Weights packed once for oneDNN's GEMM: the other packed path of a float32 model on the CPU.

Where it sits: :mod:`kvfleet.engine.kernels.packing` picks, once per process, whether a
layer's linears are packed for MKL (:mod:`kvfleet.engine.kernels.mkl_packed`) or for
oneDNN (this module); ``cpu_linear.linear`` then calls whichever :class:`PackedWeight`
the layer holds for steps of more than ``SKINNY_MAX_ROWS`` rows.

Why a second path: torch's MKL runs a generic AVX2 code path on AMD processors. On an
AMD EPYC (Zen, AVX2, 2 threads) SmolLM2's layer shapes ran at 95-130 GFLOP/s through
MKL and at 145-160 through oneDNN's JIT kernels over a weight reordered once
(``mkldnn._reorder_linear_weight``, the op torch's inductor uses when it freezes a model);
vLLM's CPU backend runs its linears on oneDNN too. The result equals ``F.linear``'s up to
float32 summation order (tested). oneDNN builds a kernel per new row count, about 1.4 ms
once, cached (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, default 1024 shapes).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from kvfleet.engine.kernels.mkl_packed import packable_input


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


class PackedWeight(NamedTuple):
    """A linear's (out, in) weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for a contiguous float32 (rows, in) ``x``."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    @property
    def streams_few_rows(self) -> bool:
        """oneDNN's GEMM walks panels: the few-row kernel streams a decode step faster."""
        return False

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can run through this packed weight."""
        return packable_input(x, self.in_features)


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` (out, in) packed for oneDNN, or None (not float32 on the CPU, or no oneDNN)."""
    if not available() or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    return PackedWeight(packed, n, k)
