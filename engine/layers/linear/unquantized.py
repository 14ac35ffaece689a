"""The float method: weights as the checkpoint stores them (float32, bfloat16, float16), laid out
for this machine's matmul kernels.

Where it sits: ``layers/linear/config.py`` names it for a float checkpoint (and for one whose
quantised weights cannot run here, dequantised at load); the model's attention and MLP blocks
(``model/projections.py``) stack their q/k/v and gate/up weights with :func:`matmul_layout` and
resolve each matmul through :meth:`FloatMethod.process` (``kernels/linear.py``'s chain: the
few-row kernel, a packed copy, ``F.linear``). Its kernels' native operands are their float32
rows (the few-row kernel) or panels (``packed.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvfleet.engine.kernels.linear import resolve_linear
from kvfleet.engine.kernels.native.skinny_gemm import load_linear
from kvfleet.engine.kernels.packing.base import PackedWeight
from kvfleet.engine.layers.linear.base import LinearKernel, LinearMethod, register


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) stored as its contiguous transpose, seen as (out, in) again.

    ``F.linear`` then multiplies by a contiguous (in, out) matrix: on the CPU, MKL's GEMM at the
    few rows of a decode step runs about twice as fast from that layout (1.5x for the LM head).
    """
    return weight.t().contiguous().t()


def matmul_layout(weight: torch.Tensor) -> torch.Tensor:
    """The layout the model's matmuls read fastest here: as stored (row-major) where the native
    few-row kernel runs the decode steps (``kernels/native/skinny_gemm.py``), else :func:`column_major`."""
    if weight.device.type == "cpu" and load_linear() is None:
        return column_major(weight)
    return weight.contiguous()


@register
class FloatMethod(LinearMethod):
    """Float weights: stacked and laid out once, run on ``kernels/linear.py``'s chain."""

    name = "float"
    prepacks = True

    def create(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        return matmul_layout(torch.cat([w.detach() for w in weights]))

    def process(
        self, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None = None
    ) -> LinearKernel:
        """``packed``: ``weight`` packed for a GEMM library after loading (``packed.py``)."""
        return resolve_linear(weight, bias, packed)

    def shard(self, weight: torch.Tensor, dim: int, span: slice) -> torch.Tensor:
        return (weight[span] if dim == 0 else weight[:, span]).contiguous()

    def embedding(self, weight: torch.Tensor) -> nn.Embedding:
        return nn.Embedding.from_pretrained(weight.to(self.dtype), freeze=True)
