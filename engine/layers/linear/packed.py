"""The packed-float method: float weights with a copy packed once for a GEMM library.

Where it sits: ``LlamaForCausalLM.prepack`` (after loading, where ``FloatMethod.prepacks``) picks a
packer of ``kernels/packing`` by name (``mkl``, ``onednn``, ``native``; ``auto`` is timed there)
and each block packs its two matmuls' weights with :meth:`PackedFloatMethod.pack`; the kernel then
takes the packed copy for the inputs it takes (prefill chunks; every row count for ``native``,
whose panels are also the one-call decode's operand) and the float chain for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.engine.kernels.linear import resolve_linear
from kvfleet.engine.kernels.packing import pack_weight
from kvfleet.engine.kernels.packing.base import PackedWeight
from kvfleet.engine.layers.linear.base import LinearKernel, register
from kvfleet.engine.layers.linear.unquantized import FloatMethod


@register
@dataclass(frozen=True)
class PackedFloatMethod(FloatMethod):
    """Float weights run through a packed copy (``packer``: a ``kernels/packing`` name)."""

    name = "packed"
    packer: str = "native"

    def pack(self, weight: torch.Tensor) -> PackedWeight | None:
        """``weight`` (out, in) packed once for this method's packer (None: it does not pack it)."""
        return pack_weight(weight.detach(), self.packer)

    def process(
        self, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None = None
    ) -> LinearKernel:
        """``packed``: the copy :meth:`pack` made (packed here when not given)."""
        return resolve_linear(weight, bias, packed if packed is not None else self.pack(weight))
