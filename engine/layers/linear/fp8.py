"""The fp8 method: e4m3 weights with one float32 scale per output row, on a GPU of cc >= 8.9.

Where it sits: ``layers/linear/config.py`` names it for ``--quantization fp8`` (floats quantised at
load, :meth:`Fp8Method.quantize`) and for a compressed-tensors FP8 checkpoint where ``_scaled_mm``
runs; elsewhere such a checkpoint is served by the float method, dequantised at load
(:meth:`Fp8Method.dequantised`). ``kernels/fp8_linear.py`` holds the kernel: per-token e4m3
activations and ``torch._scaled_mm``; a shape it does not take runs dequantised. No native CPU
operand: the one-call decode never takes an fp8 model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvfleet.engine.kernels.fp8_linear import (
    Fp8Weight,
    concat_fp8,
    quantize_fp8_per_channel,
    resolve_fp8_linear,
)
from kvfleet.engine.layers.linear.base import LinearKernel, LinearMethod, register


@register
class Fp8Method(LinearMethod):
    """Per-channel e4m3 through ``torch._scaled_mm`` (dequantised to ``dtype`` where it cannot run)."""

    name = "fp8"

    def quantize(self, weight: torch.Tensor) -> Fp8Weight:
        """A float (out, in) weight to per-channel e4m3 on its device (amax / 448 per row)."""
        return quantize_fp8_per_channel(weight)

    def dequantised(self, weight: Fp8Weight) -> torch.Tensor:
        return weight.dequantised(self.dtype)

    def create(self, weights: Sequence[Fp8Weight]) -> Fp8Weight:
        return weights[0] if len(weights) == 1 else concat_fp8(list(weights))

    def process(self, weight: Fp8Weight, bias: torch.Tensor | None) -> LinearKernel:
        return resolve_fp8_linear(weight, bias, self.dtype)

    def shard(self, weight: Fp8Weight, dim: int, span: slice) -> Fp8Weight:
        """Rows keep their scales; a slice of columns keeps every row's scale (exact: w = scale * q)."""
        if dim == 0:
            return Fp8Weight(weight.qweight[span].contiguous(), weight.scale[span].contiguous())
        return Fp8Weight(weight.qweight[:, span].contiguous(), weight.scale)

    def embedding(self, weight: Fp8Weight) -> nn.Embedding:
        return nn.Embedding.from_pretrained(self.dequantised(weight), freeze=True)
