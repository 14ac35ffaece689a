"""One interface for a linear in any weight format, and the registry that names the formats.

Where it sits: ``layers/linear/config.py`` resolves one :class:`~.config.QuantizationConfig` per
engine and names the :class:`LinearMethod` every layer matmul gets; the loaders
(``loader/hf_loader.py``, ``loader/gguf_loader.py``, ``loader/hf_quant.py``) read raw weights and
hand them to that method, which stacks them (:meth:`LinearMethod.create`), lays them out or packs
them once (:meth:`LinearMethod.process`: the after-loading step) and returns a
:class:`LinearKernel`, whose call is the method's apply. What the one-call native decode needs of a
matmul is the kernel's own :meth:`LinearKernel.native_operand` (``model/fused_layers.py`` asks
nothing else). As vLLM's ``QuantizeMethodBase``, with the weights bound into the kernel.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kvfleet.engine.kernels.operand import LinearKernel, NativeOperand, native_operand
from kvfleet.engine.layers.linear.bytes import storage_bytes

__all__ = ["LinearKernel", "LinearMethod", "NativeOperand", "get_method", "native_operand", "register"]


@dataclass(frozen=True)
class LinearMethod(ABC):
    """How one weight format is loaded, laid out, run and embedded (one module per format).

    ``dtype``: the model's compute dtype (what a weight dequantised at load becomes, and what the
    embedding returns). ``prepacks``: the runner may pack the model's weights for a GEMM library
    after loading (``LlamaForCausalLM.prepack``): float weights only."""

    name: ClassVar[str]
    prepacks: ClassVar[bool] = False
    dtype: torch.dtype = torch.float32

    @abstractmethod
    def create(self, weights: Sequence[Any]) -> Any:
        """The weights of several linears of one input (q/k/v, gate/up) stacked by output rows, as
        this format stores one matmul's weight."""

    @abstractmethod
    def process(self, weight: Any, bias: torch.Tensor | None) -> LinearKernel:
        """After loading: ``weight`` laid out or packed once for this machine's kernel, bound with
        ``bias`` into the kernel every step calls (its call is this method's apply)."""

    def load(self, weights: Sequence[Any], bias: torch.Tensor | None) -> LinearKernel:
        """Linears of one input, outputs side by side, as one resolved matmul."""
        return self.process(self.create(weights), bias)

    @abstractmethod
    def shard(self, weight: Any, dim: int, span: slice) -> Any:
        """This rank's part of one linear's ``weight`` under tensor parallelism: output rows
        (``dim`` 0, column-parallel) or input columns (``dim`` 1, row-parallel) ``span``."""

    def apply(self, kernel: LinearKernel, x: torch.Tensor) -> torch.Tensor:
        """``x`` through the matmul: the kernel's own call (the model calls the kernel directly)."""
        return kernel(x)

    def native_operand(self, kernel: LinearKernel) -> NativeOperand | None:
        """What the one-call native decode reads of this matmul: the kernel's own answer."""
        return native_operand(kernel)

    @abstractmethod
    def embedding(self, weight: Any) -> nn.Embedding:
        """The token embedding over ``weight`` (vocab, hidden) in this format, rows out in ``dtype``."""

    def resident_bytes(self, kernel: LinearKernel) -> int:
        """Bytes the kernel's weights hold (each storage once; a library's opaque copy uncounted)."""
        return storage_bytes([kernel])


_METHODS: dict[str, type[LinearMethod]] = {}


def register(cls: type[LinearMethod]) -> type[LinearMethod]:
    """Name the method class ``cls`` (``cls.name``) for the quantization config; names are unique."""
    if cls.name in _METHODS:
        raise ValueError(f"linear method {cls.name!r} is registered twice")
    _METHODS[cls.name] = cls
    return cls


def get_method(name: str, dtype: torch.dtype = torch.float32) -> LinearMethod:
    """The method registered as ``name``, computing in ``dtype`` (the formats' modules register on
    import of ``layers.linear``)."""
    try:
        return _METHODS[name](dtype)
    except KeyError:
        raise ValueError(f"no linear method {name!r}; registered: {registered()}") from None


def registered() -> tuple[str, ...]:
    return tuple(sorted(_METHODS))
