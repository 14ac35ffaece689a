"""The model's matmul weights as the kernels want them: laid out, packed several linears into one,
(pre)packed for a GEMM library, and each resolved to one callable by its linear method
(``layers/linear``: ``unquantized.FloatMethod``, ``packed.PackedFloatMethod``).

Where it sits: ``engine/model/llama.py``'s attention and MLP blocks are :class:`ProjectedBlock`\\ s:
their input linears (q/k/v; gate/up) run as one matmul (:func:`pack_linears`) and their output
linear (o_proj; down_proj) as another. ``LlamaForCausalLM.pack`` lays the weights out
(:func:`store_for_matmul`) and packs them once after loading, ``prepack`` adds a GEMM library's
copies; each time the block's two matmuls are resolved again, so a step only calls them.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import nn

from kvfleet.engine.kernels.linear import Linear
from kvfleet.engine.kernels.packing.base import PackedWeight
from kvfleet.engine.layers.linear.packed import PackedFloatMethod
from kvfleet.engine.layers.linear.unquantized import FloatMethod, column_major, matmul_layout

__all__ = [
    "Matmuls",
    "Packed",
    "ProjectedBlock",
    "column_major",
    "matmul_layout",
    "pack_linears",
    "store_for_matmul",
]
FLOAT_METHOD = FloatMethod()


def store_for_matmul(linear: nn.Linear) -> None:
    weight = linear.weight.detach()
    laid_out = matmul_layout(weight)
    if laid_out is not weight:
        linear.weight = nn.Parameter(laid_out, requires_grad=False)


class Packed(NamedTuple):
    """Several linears of the same input run as one matmul: ``F.linear(x, weight, bias)``.

    ``slices`` names each linear's columns of the output (its Hugging Face name, e.g. ``q_proj``
    → ``slice(0, heads * head_dim)``): what a per-projection delta (a LoRA adapter) adds onto.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    slices: dict[str, slice]


def pack_linears(owner: nn.Module, names: tuple[str, ...]) -> Packed:
    """One weight (and bias) for the linears ``names`` of ``owner``, stacked by output rows.

    The linears' parameters become views of the packed tensors, so the weights are held once
    and ``state_dict`` keeps the checkpoint's names.
    """
    linears = [getattr(owner, name) for name in names]
    weight = FLOAT_METHOD.create([lin.weight for lin in linears])
    biases = [lin.bias.detach() for lin in linears if lin.bias is not None]
    if biases and len(biases) != len(linears):
        raise ValueError("packed linears must all have a bias or none")
    bias = torch.cat(biases) if biases else None
    row, slices = 0, {}
    for name, lin in zip(names, linears, strict=True):
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row : row + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[row : row + rows], requires_grad=False)
        slices[name] = slice(row, row + rows)
        row += rows
    return Packed(weight, bias, slices)


class Matmuls(NamedTuple):
    """A block's two matmuls, each resolved to the callable that runs it here."""

    inputs: Linear
    output: Linear


class ProjectedBlock(nn.Module):
    """A block whose input linears ``INPUTS`` run as one packed matmul and whose output linear is
    ``OUTPUT``: what the attention (q/k/v, o_proj) and the MLP (gate/up, down_proj) share."""

    INPUTS: ClassVar[tuple[str, ...]]
    OUTPUT: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.fused: Packed | None = None  # the input linears packed by pack()
        self.packed_in: PackedWeight | None = None  # packed for a GEMM library by prepack()
        self.packed_out: PackedWeight | None = None
        self._matmuls: Matmuls | None = None
        # resolved by the loader's linear method (quantised weights: loader/gguf_loader.py,
        # loader/hf_quant.py); wins over resolving these linears as floats
        self.fixed: Matmuls | None = None

    def output_linear(self) -> nn.Linear:
        linear = getattr(self, self.OUTPUT)
        assert isinstance(linear, nn.Linear)
        return linear

    def pack(self) -> None:
        """Run the input linears as one matmul (after the weights are loaded and laid out; the first
        forward packs if nobody did)."""
        self.fused = pack_linears(self, self.INPUTS)
        self._matmuls = None

    def prepack(self, kind: str) -> None:
        """Keep packed copies (packer ``kind``) of both matmuls' weights (after :meth:`pack`)."""
        method = PackedFloatMethod(packer=kind)
        self.packed_in = method.pack(self.fused_inputs().weight)
        self.packed_out = method.pack(self.output_linear().weight)
        self._matmuls = None

    def fused_inputs(self) -> Packed:
        if self.fused is None:
            self.pack()
        assert self.fused is not None
        return self.fused

    def matmuls(self) -> Matmuls:
        """The two matmuls as resolved for the weights as (pre)packed now (resolved on first use)."""
        if self.fixed is not None:
            return self.fixed
        if self._matmuls is None:
            fused, out = self.fused_inputs(), self.output_linear()
            self._matmuls = Matmuls(
                FLOAT_METHOD.process(fused.weight, fused.bias, self.packed_in),
                FLOAT_METHOD.process(out.weight, out.bias, self.packed_out),
            )
        return self._matmuls
