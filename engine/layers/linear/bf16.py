"""The bf16 method: a bfloat16 model on the CPU keeps bf16 weights and computes in float32.

Where it sits: ``layers/linear/config.py`` names it for a float checkpoint served ``--dtype bfloat16``
on the CPU where the native library builds (:func:`bf16_config`); the runner then computes in
float32 (``QuantizationConfig.compute_dtype``) and ``loader/hf_quant.py`` hands every linear (the
decoder's matmuls, the LM head) and the embedding to this method, which lays each weight out once
in the kernel's panels (``kernels/native/bf16_gemm.py``, ``csrc/bf16_gemm.c``).

Design (llama.cpp's): the WEIGHTS are bf16 (linears, embedding, LM head: half float32's bytes, a
decode step streams half the memory) while the activations, the norms, the residual stream and the
KV cache stay float32; each matmul rounds its input rows to bf16 at the kernel's door (as oneDNN's
bf16 GEMM does) and sums exact products in float32. That is closer to float32 than torch's all-bf16
path, which also rounds every output, norm and cache entry to bf16. The same kernel runs every row
count (AMX tiles from 8 rows: at 64-256 rows as fast as torch's oneDNN bf16 GEMM on the LM head,
which would need a second, row-major copy of the weights), and its panels are the one-call decode's
``BF16_PANELS`` operands (``model/fused_layers.py``). The GPU, and a CPU where the library does not
build, keep the all-bf16 torch path (the ``float`` method in bf16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvfleet.engine.kernels.linear import FlatNativeLinear
from kvfleet.engine.kernels.native.bf16_gemm import Bf16Weight, NativeBf16, load_bf16, pack_panels
from kvfleet.engine.kernels.native.decode_layers import BF16_PANELS
from kvfleet.engine.kernels.operand import NativeOperand
from kvfleet.engine.layers.linear.base import LinearKernel, LinearMethod, register


@dataclass(frozen=True, slots=True)
class Bf16Linear(FlatNativeLinear[NativeBf16, Bf16Weight]):
    """``x @ w^T + bias`` with ``w`` in bf16 panels, ``x`` and the output float32, on the native kernel."""

    def native_operand(self) -> NativeOperand | None:
        """The panels on the native kernel's best path (AMX from ``AMX_MIN_ROWS``, as the per-op call): any rows."""
        return NativeOperand(self.weight.panels, self.bias, "bf16", BF16_PANELS, path=self.native.path)


class Bf16Embedding(nn.Embedding):
    """The token embedding kept in bf16 rows: the rows a step reads come out in ``out_dtype`` (float32)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        n, k = weight.shape
        super().__init__(n, k, _weight=torch.empty(n, k, device="meta"))
        self.bf16 = weight
        self.out_dtype = dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.bf16[input.cpu()].to(dtype=self.out_dtype, device=input.device)


@register
class Bf16Method(LinearMethod):
    """bf16 panels on the native bf16 kernel (``dtype``, the compute dtype, is float32)."""

    name = "bf16"

    def quantize(self, weight: torch.Tensor) -> Bf16Weight:
        """A float (out, in) weight rounded to bf16 (nearest even) in the kernel's panels."""
        return pack_panels(weight)

    def create(self, weights: Sequence[Bf16Weight]) -> Bf16Weight:
        if len(weights) == 1:
            return weights[0]
        return pack_panels(torch.cat([w.dense() for w in weights]))

    def process(self, weight: Bf16Weight, bias: torch.Tensor | None) -> LinearKernel:
        native = load_bf16()
        if native is None:  # bf16_config names this method only where the library builds
            raise RuntimeError("the bf16 method needs the native library, which did not build here")
        return Bf16Linear(native, weight, None if bias is None else bias.float().contiguous())

    def shard(self, weight: Bf16Weight, dim: int, span: slice) -> Bf16Weight:
        dense = weight.dense()
        return pack_panels(dense[span] if dim == 0 else dense[:, span])

    def embedding(self, weight: Bf16Weight) -> nn.Embedding:
        return Bf16Embedding(weight.dense().contiguous(), self.dtype)
