"""The int8 method: per-channel int8 weights (one float32 scale per output row) on the CPU.

Where it sits: ``layers/linear/config.py`` names it for ``--quantization int8`` (floats quantised
at load, :meth:`Int8Method.quantize`) and for a compressed-tensors W8A8 int8 checkpoint on the CPU;
``loader/hf_quant.py`` hands it each linear's :class:`Int8Weight`. The kernel
(``kernels/int8_linear.py``) quantises each token's activations to int8 and takes exact int32
dots: the native kernel below ``ONEDNN_MIN_ROWS`` rows (the one-call decode's operand),
``torch._int_mm`` from there. The embedding keeps int8 rows and dequantises the rows a step reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvfleet.engine.kernels.int8_linear import concat_int8, resolve_int8_linear
from kvfleet.engine.kernels.native.int8_gemm import Int8Weight, quantize_per_channel
from kvfleet.engine.layers.linear.base import LinearKernel, LinearMethod, register


class Int8Embedding(nn.Embedding):
    """The token embedding kept in int8 rows (one scale each): only the rows a step reads are dequantised."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype) -> None:
        n, k = weight.out_features, weight.in_features
        super().__init__(n, k, _weight=torch.empty(n, k, device="meta"))
        self.int8 = weight
        self.out_dtype = dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ids = input.cpu()
        rows = self.int8.qweight[ids].float() * self.int8.scale[ids].unsqueeze(-1)
        return rows.to(dtype=self.out_dtype, device=input.device)


@register
class Int8Method(LinearMethod):
    """Per-channel int8 on the native int8 kernel (float32 ``F.linear`` where it does not build)."""

    name = "int8"

    def quantize(self, weight: torch.Tensor) -> Int8Weight:
        """A float (out, in) weight to per-channel int8 (symmetric, amax / 127 per row)."""
        return quantize_per_channel(weight)

    def create(self, weights: Sequence[Int8Weight]) -> Int8Weight:
        return weights[0] if len(weights) == 1 else concat_int8(list(weights))

    def process(self, weight: Int8Weight, bias: torch.Tensor | None) -> LinearKernel:
        return resolve_int8_linear(weight, None if bias is None else bias.float())

    def shard(self, weight: Int8Weight, dim: int, span: slice) -> Int8Weight:
        """Rows keep their scales; a slice of columns keeps every row's scale (exact: w = scale * q)."""
        if dim == 0:
            return Int8Weight(weight.qweight[span].contiguous(), weight.scale[span].contiguous())
        return Int8Weight(weight.qweight[:, span].contiguous(), weight.scale)

    def embedding(self, weight: Int8Weight) -> nn.Embedding:
        return Int8Embedding(weight, self.dtype)
