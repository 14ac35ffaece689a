"""A quantised linear resolved once, at load, to the callable that runs it (``linear.py``'s rule).

Where it sits: ``engine/loader/gguf_loader.py`` resolves each linear whose weight stays in GGUF
blocks with :func:`resolve_quant_linear` and hands the result to the model's blocks in place of
``resolve_linear``'s; a step only calls it. The chain: the native quantised kernel
(``native/quant_gemm.py``) for float32 CPU inputs, where the library builds, on the blocks repacked
once here (:func:`packed`: the file's rows are dropped, the packed copy is the only one); else the
weight dequantised once to float32 and ``F.linear`` (correct, but the memory saving is gone: the
loader logs it). Several linears of one input whose formats differ run as :class:`ConcatLinear`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvfleet.engine.kernels.linear import FlatNativeLinear, Linear, TorchLinear
from kvfleet.engine.kernels.native.quant_gemm import NativeQuant, PackedQuant, QuantWeight, load_quant
from kvfleet.engine.kernels.operand import NativeOperand


@dataclass(frozen=True, slots=True)
class QuantLinear(FlatNativeLinear[NativeQuant, PackedQuant]):
    """``x @ dequantise(weight)^T + bias`` on the native kernel (int8 activations per 32)."""

    def native_operand(self) -> NativeOperand | None:
        """The repacked blocks, on the kernel's path (any row count: the per-op path runs it too)."""
        w = self.weight
        return NativeOperand(w.data, self.bias, "quant", w.ggml_type, path=self.native.path)


@dataclass(frozen=True, slots=True)
class ConcatLinear:
    """Several linears of one input, outputs side by side (one call each: their formats differ)."""

    parts: tuple[Linear, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def native_operand(self) -> NativeOperand | None:
        return None  # several calls: the native call runs one kernel per matmul


def dequantised(weight: QuantWeight | PackedQuant) -> torch.Tensor:
    """The weight as float32 (out, in): ``gguf.quants.dequantize`` of its blocks (packed: unpacked first)."""
    kind = GGMLQuantizationType(weight.ggml_type)
    blocks = weight.rows(torch.arange(weight.out_features))
    values = dequantize(blocks.numpy(), kind).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(values.reshape(weight.out_features, weight.in_features)))


def packed(weight: QuantWeight | PackedQuant) -> QuantWeight | PackedQuant:
    """``weight`` repacked for the native kernel where the library builds; else as it is."""
    native = load_quant()
    if native is None or isinstance(weight, PackedQuant):
        return weight
    return native.pack(weight)


def resolve_quant_linear(weight: QuantWeight | PackedQuant, bias: torch.Tensor | None = None) -> Linear:
    """The native kernel on ``weight``'s packed blocks where it builds; else float32 ``F.linear``."""
    ready = packed(weight)
    if isinstance(ready, QuantWeight):
        return TorchLinear(dequantised(ready), bias)
    return QuantLinear(ready.native, ready, bias)


def concat_rows(weights: Sequence[QuantWeight]) -> QuantWeight | None:
    """One weight of the rows of ``weights`` stacked (one matmul), where they share a format; else None."""
    kinds = {w.ggml_type for w in weights}
    widths = {w.in_features for w in weights}
    if len(kinds) != 1 or len(widths) != 1:
        return None
    blocks = torch.cat([w.blocks for w in weights]).contiguous()
    return QuantWeight(blocks, weights[0].ggml_type, weights[0].in_features)
