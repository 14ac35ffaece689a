"""Each matmul of the model resolved once, at load, to the one callable that runs it on this machine.

Where it sits: ``engine/model/llama.py`` resolves every linear (packed q/k/v, o_proj, packed
gate/up, down_proj, the LM head) with :func:`resolve_linear` when its weights are laid out and
(pre)packed, and calls the result on every step; nothing is chosen per call but what only the
input can tell (its row count, dtype and layout). As vLLM's ``dispatch_cpu_unquantized_gemm``
does, the choice is a chain built once:

- a weight packed for the native GEMM (``packing/native.py``) runs every input it takes: its
  panels stream a decode step's few rows as fast as the few-row kernel;
- otherwise a float32 CPU weight runs a step of at most ``SKINNY_MAX_ROWS`` rows (a decode
  batch) on the few-row kernel (``native/skinny_gemm.py``) where the native library builds;
- then the weight packed for MKL or oneDNN (``packing``), where there is one, for the inputs it
  takes (prefill chunks);
- else ``F.linear``, which packs the weight on every call.

Measured on SmolLM2's layer shapes, 2 threads, weights streamed from memory (bench/kernels/
skinny_linear_micro.py, bench/results/skinny_linear.txt), per 30 layers: 8 rows 22.5 ms
against torch's 36.8; 16 rows 34.0 against 45.7; 1 row 17.7 both; 32 rows 58.5 against
56.8 (torch's GEMM is faster from there on, hence the threshold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F

from kvfleet.engine.kernels.native.skinny_gemm import SKINNY_MAX_ROWS, NativeLinear, load_linear
from kvfleet.engine.kernels.operand import LinearKernel, NativeOperand
from kvfleet.engine.kernels.packing.base import PackedWeight
from kvfleet.engine.kernels.packing.native import NativePackedWeight

Linear = LinearKernel  # a resolved matmul: called each step, and asked once for its native operand
NativeT = TypeVar("NativeT")  # a native kernel's loaded library (``NativeBf16``, ``NativeQuant``)
WeightT = TypeVar("WeightT")  # the weight laid out for it (with ``out_features``)


@dataclass(frozen=True, slots=True)
class TorchLinear:
    """``F.linear``: what every chain ends in."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def native_operand(self) -> NativeOperand | None:
        return None  # torch's GEMM: the native call would not run the per-op path's kernel


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """The packed weight for the inputs it takes, ``fallback`` for the rest."""

    packed: PackedWeight
    bias: torch.Tensor | None
    fallback: Linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, self.bias) if self.packed.takes(x) else self.fallback(x)

    def native_operand(self) -> NativeOperand | None:
        """The native GEMM's panels (which take every row count); a library's packed copy: None."""
        if not isinstance(self.packed, NativePackedWeight):
            return None
        return NativeOperand(self.packed.panels.detach(), self.bias, "panels")


@dataclass(frozen=True, slots=True)
class SkinnyLinear:
    """The few-row kernel for a decode step's rows (:func:`few_rows`), ``fallback`` for the rest."""

    native: NativeLinear
    weight: torch.Tensor
    bias: torch.Tensor | None
    fallback: Linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if few_rows(x, self.weight.shape[1]):
            return self.native(x, self.weight, self.bias)
        return self.fallback(x)

    def native_operand(self) -> NativeOperand | None:
        """The rows the few-row kernel reads, up to its row count; None beside a library's packed
        copy (a step the native call would take may be one the per-op path packs)."""
        if isinstance(self.fallback, PackedLinear):
            return None
        return NativeOperand(self.weight.detach(), self.bias, "rows", max_rows=SKINNY_MAX_ROWS)


@dataclass(frozen=True, slots=True)
class FlatNativeLinear(Generic[NativeT, WeightT]):
    """``native(rows, weight, bias)`` over ``x`` of any leading shape and dtype: the native kernels take
    a flat float32 batch (as the model passes it) and give float32 rows, returned in ``x``'s shape and
    dtype. The native-kernel linears (bf16 panels, GGUF blocks) are this call plus their operand."""

    native: NativeT
    weight: WeightT
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        native: Any = self.native
        weight: Any = self.weight
        if x.dim() == 2 and x.dtype == torch.float32:
            return native(x, weight, self.bias)  # type: ignore[no-any-return]
        out = native(x.reshape(-1, x.shape[-1]).float(), weight, self.bias)
        return out.reshape(*x.shape[:-1], weight.out_features).to(x.dtype)  # type: ignore[no-any-return]


def skinny_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the few-row kernel takes this weight: contiguous float32 on the CPU (bias alike)."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def few_rows(x: torch.Tensor, in_features: int) -> bool:
    """Whether the few-row kernel takes this input: at most ``SKINNY_MAX_ROWS`` contiguous float32
    CPU rows of ``in_features``, outside autograd."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= SKINNY_MAX_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and x.shape[1] == in_features
        and not torch.is_grad_enabled()
    )


def resolve_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, packed: PackedWeight | None = None
) -> Linear:
    """``F.linear(x, weight, bias)`` as the chain of kernels this machine runs it on (the module
    docstring's order); ``packed``: ``weight`` packed at load by a packer of ``packing``."""
    chain: Linear = TorchLinear(weight, bias)
    if packed is not None:
        chain = PackedLinear(packed, bias, chain)
        if packed.streams_few_rows:
            return chain
    native = load_linear() if skinny_weight(weight, bias) else None
    return chain if native is None else SkinnyLinear(native, weight, bias, chain)
