"""What the one-call native decode reads of one matmul, as each linear kernel offers it.

Where it sits: every resolved linear (``kernels/linear.py``, ``quant_linear.py``, ``int8_linear.py``,
``fp8_linear.py``, ``layers/linear/bf16.py``) answers ``native_operand()`` with a :class:`NativeOperand` or None;
``model/fused_layers.py`` builds the native call's per-layer operands from them alone, and
``layers/linear/base.py`` makes it part of the one linear interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

OperandKind = Literal["rows", "panels", "quant", "bf16"]


@dataclass(frozen=True, slots=True)
class NativeOperand:
    """One matmul as the one-call decode (``kernels/native/decode_layers.py``) reads it.

    ``kind``: ``rows``, float32 (out, in) rows on the few-row kernel; ``panels``, the native GEMM's
    float32 panels; ``quant``, the quantised kernels' operand of ``type`` (a ggml block type, or
    ``INT8_CHANNEL`` with per-row ``scale``); ``bf16``, the bf16 kernel's panels (``type``
    ``BF16_PANELS``, ``native/bf16_gemm.py``). ``path``: the quantised or bf16 kernel's path; ``max_rows``:
    the most rows a step may have for the per-op path to run this same kernel (None: any)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    kind: OperandKind
    type: int = 0
    scale: torch.Tensor | None = None
    path: str | None = None
    max_rows: int | None = None

    @property
    def key(self) -> tuple[str, str | None, int | None]:
        """What every matmul of one native call must share: its kind, kernel path and row limit."""
        return self.kind, self.path, self.max_rows


@runtime_checkable
class LinearKernel(Protocol):
    """A matmul resolved once, at load, to what runs it here: calling it is the method's apply."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def native_operand(self) -> NativeOperand | None:
        """This matmul as the one-call decode reads it, or None where that call cannot run it."""
        ...


def native_operand(kernel: object) -> NativeOperand | None:
    """``kernel``'s operand for the one-call decode; None for a callable that offers none."""
    return kernel.native_operand() if isinstance(kernel, LinearKernel) else None
