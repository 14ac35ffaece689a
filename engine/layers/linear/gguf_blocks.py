"""The GGUF method: linears kept in a GGUF file's blocks, repacked once for the native kernel.

Where it sits: ``layers/linear/config.py`` names it for a GGUF ``--model`` (detected, or
``--quantization gguf``); ``loader/gguf_loader.py`` reads each linear's block rows (or floats,
where the file stores some in F32/F16) and hands them here. :meth:`GgufMethod.create` stacks
q/k/v (gate/up) into one weight where they share a block format, :meth:`GgufMethod.process`
repacks the blocks into groups of 16 output rows (``native/csrc/quant_layout.h``, the only copy
kept) and binds ``kernels/quant_linear.py``'s kernel; linears of mixed formats run as one call
each (:class:`Parts`). The embedding looks its rows up in the blocks (a tied LM head reads the
same packed blocks: one copy of that matrix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from kvfleet.engine.errors import ModelLoadError
from kvfleet.engine.kernels.linear import Linear, resolve_linear
from kvfleet.engine.kernels.native.quant_gemm import BLOCK_LAYOUTS, PackedQuant, QuantWeight
from kvfleet.engine.kernels.quant_linear import ConcatLinear, concat_rows, packed, resolve_quant_linear
from kvfleet.engine.layers.linear.base import LinearKernel, LinearMethod, register

# the file's blocks, blocks packed for the kernel, or float32 (out, in) where the file stores floats
Weight = QuantWeight | PackedQuant | torch.Tensor


@dataclass(frozen=True, slots=True)
class Parts:
    """Linears of one input whose formats differ: one call each, outputs side by side."""

    weights: tuple[Weight, ...]


class QuantEmbedding(nn.Embedding):
    """The token embedding looked up in GGUF blocks: only the rows a step reads are dequantised."""

    def __init__(self, weight: QuantWeight | PackedQuant) -> None:
        n, k = weight.out_features, weight.in_features
        super().__init__(n, k, _weight=torch.empty(n, k, device="meta"))
        self.blocks = weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ids = input.reshape(-1).cpu()
        rows = self.blocks.rows(ids)
        if self.blocks.ggml_type == 8:  # Q8_0, the common embedding format: f16 scale, 32 int8
            per_row = self.blocks.in_features // 32
            blocks = rows.reshape(-1, per_row, 34)
            scale = blocks[:, :, :2].contiguous().view(torch.float16).float()
            values = blocks[:, :, 2:].contiguous().view(torch.int8).float() * scale
        else:
            values = torch.from_numpy(
                dequantize(rows.numpy(), GGMLQuantizationType(self.blocks.ggml_type)).astype(np.float32)
            )
        return values.reshape(*input.shape, self.blocks.in_features).to(input.device)


def _rows(w: Weight) -> int:
    return int(w.shape[0]) if isinstance(w, torch.Tensor) else w.out_features


@register
class GgufMethod(LinearMethod):
    """GGUF blocks on the native quantised kernel (float32 CPU compute); floats on the float chain."""

    name = "gguf"

    def create(self, weights: Sequence[Weight]) -> Weight | Parts:
        raw = [w for w in weights if isinstance(w, QuantWeight)]
        if len(raw) == len(weights):
            stacked = concat_rows(raw)
            if stacked is not None:
                return stacked
        floats = [w for w in weights if isinstance(w, torch.Tensor)]
        if len(floats) == len(weights):
            return torch.cat(floats).contiguous()
        return weights[0] if len(weights) == 1 else Parts(tuple(weights))

    def process(self, weight: Weight | Parts, bias: torch.Tensor | None) -> LinearKernel:
        if not isinstance(weight, Parts):
            return self._one(weight, bias)
        parts: list[Linear] = []
        row = 0
        for w in weight.weights:
            rows = _rows(w)
            parts.append(self._one(w, None if bias is None else bias[row : row + rows].contiguous()))
            row += rows
        return ConcatLinear(tuple(parts))

    def _one(self, weight: Weight, bias: torch.Tensor | None) -> LinearKernel:
        if isinstance(weight, torch.Tensor):
            return resolve_linear(weight, bias)
        return resolve_quant_linear(weight, bias)

    def shared(self, weight: Weight) -> Weight:
        """``weight`` repacked once where it is blocks, to be read by both the embedding and a tied LM head."""
        return weight if isinstance(weight, torch.Tensor) else packed(weight)

    def shard(self, weight: Weight, dim: int, span: slice) -> Weight:
        """Rows of blocks, or columns in whole blocks (the activations' blocks of 32 stay whole, so
        each rank's partial sums are the single rank's); a slice across a block is refused."""
        if isinstance(weight, torch.Tensor):
            return (weight[span] if dim == 0 else weight[:, span]).contiguous()
        if not isinstance(weight, QuantWeight):
            raise ValueError("shard GGUF blocks as the file holds them, before they are repacked")
        if dim == 0:
            return QuantWeight(weight.blocks[span].contiguous(), weight.ggml_type, weight.in_features)
        per_block, size = BLOCK_LAYOUTS[weight.ggml_type]
        start, stop = span.start or 0, weight.in_features if span.stop is None else span.stop
        if start % per_block or stop % per_block:
            kind = GGMLQuantizationType(weight.ggml_type).name
            raise ModelLoadError(f"columns {start}:{stop} cut its blocks of {per_block} (GGUF type {kind})")
        rows = weight.blocks.reshape(weight.out_features, -1, size)[:, start // per_block : stop // per_block]
        return QuantWeight(rows.reshape(weight.out_features, -1).contiguous(), weight.ggml_type, stop - start)

    def embedding(self, weight: Weight) -> nn.Embedding:
        if isinstance(weight, torch.Tensor):
            return nn.Embedding.from_pretrained(weight.to(self.dtype), freeze=True)
        return QuantEmbedding(weight)
