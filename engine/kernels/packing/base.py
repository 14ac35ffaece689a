"""What every packer of a float32 model's weights is: :class:`PackedWeight`, the one base class.

Where it sits: :mod:`kvfleet.engine.kernels.packing` registers the packers by name (``mkl``,
``onednn``, ``native``); each subclasses :class:`PackedWeight` with its own layout and GEMM call,
and inherits the rest: which weights it takes (float32 (out, in) CPU matrices, where the
backend is available), which inputs (:func:`packable_input`), and whether it streams a decode
step's few rows (``streams_few_rows``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


def packable_input(x: torch.Tensor, in_features: int) -> bool:
    """Whether ``x`` is what a packed float32 weight of ``in_features`` inputs multiplies (every
    packer alike): contiguous float32 CPU rows of that width, outside autograd."""
    return (
        x.dim() == 2
        and x.shape[0] > 0
        and x.shape[1] == in_features
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and not torch.is_grad_enabled()
    )


class PackedWeight(ABC):
    """A linear's (out, in) weight packed once: ``F.linear(x, weight, bias)`` for the inputs it
    :meth:`takes`. Built by :meth:`pack`, never directly."""

    # Whether a decode step's few rows run here as fast as on the unpacked few-row kernel
    # (the linear then runs every row count here). A GEMM that walks panels does not.
    streams_few_rows: ClassVar[bool] = False

    def __init__(self, out_features: int, in_features: int) -> None:
        self.out_features = out_features
        self.in_features = in_features

    @classmethod
    @abstractmethod
    def available(cls) -> bool:
        """Whether this packer's GEMM runs here."""

    @classmethod
    @abstractmethod
    def from_matrix(cls, source: torch.Tensor) -> PackedWeight:
        """``source`` (a contiguous float32 (out, in) CPU matrix) packed."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for a contiguous float32 (rows, in) ``x``."""

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight | None:
        """``weight`` (out, in) packed, or None (not a float32 CPU matrix, or the GEMM not available)."""
        if not cls.available() or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        if weight.dim() != 2:
            return None
        return cls.from_matrix(weight.detach().contiguous())

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can run through this packed weight."""
        return packable_input(x, self.in_features)
