"""A quantised weight with one float32 scale per output row: what the int8 method's native kernel
(``native/int8_gemm.py``) and the fp8 GPU linear (``fp8_linear.py``) both store, each checking its own
element type in ``__post_init__`` and raising its own error."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RowScaledWeight:
    """``qweight`` (out, in), one byte an element, and ``scale`` (out,) float32: w = scale * q."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def check_scale(self, error: type[Exception]) -> None:
        """Raise ``error`` unless ``scale`` is float32 with one entry per output row."""
        if self.scale.dtype != torch.float32 or self.scale.shape != (self.qweight.shape[0],):
            raise error(f"scale must be float32 ({self.qweight.shape[0]},), got {tuple(self.scale.shape)}")

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + 4 * self.scale.numel()
