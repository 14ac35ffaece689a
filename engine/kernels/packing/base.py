"""What every packer of a model's CPU weights is: :class:`PackedWeight`, the one base class.

Where it sits: :mod:`kvfleet.engine.kernels.packing` registers the packers by name (``mkl``,
``onednn``, ``native``); each subclasses :class:`PackedWeight` with its own layout and GEMM call,
and inherits the rest (:class:`LibraryPackedWeight`, whether its library loads): which weights it takes ((out, in) CPU matrices of a dtype it
:meth:`~PackedWeight.packs_dtype`: float32 for all, bfloat16 too for oneDNN's, where the backend is
available), which inputs (:func:`packable_input`: rows of the weight's dtype), and whether it
streams a decode step's few rows (``streams_few_rows``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

import torch


def packable_input(x: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``x`` is what a packed ``dtype`` weight of ``in_features`` inputs multiplies (every
    packer alike): contiguous CPU rows of that width and dtype, outside autograd."""
    return (
        x.dim() == 2
        and x.shape[0] > 0
        and x.shape[1] == in_features
        and x.dtype == dtype
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

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype = torch.float32) -> None:
        self.out_features = out_features
        self.in_features = in_features
        self.dtype = dtype  # the weight's, and the inputs' it takes

    @classmethod
    @abstractmethod
    def available(cls) -> bool:
        """Whether this packer's GEMM runs here."""

    @classmethod
    def packs_dtype(cls, dtype: torch.dtype) -> bool:
        """Whether this packer's GEMM takes weights of ``dtype`` (float32 unless it says more)."""
        return dtype == torch.float32

    @classmethod
    @abstractmethod
    def from_matrix(cls, source: torch.Tensor) -> PackedWeight:
        """``source`` (a contiguous (out, in) CPU matrix of a dtype :meth:`packs_dtype` takes) packed."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for a contiguous (rows, in) ``x`` of the weight's dtype."""

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight | None:
        """``weight`` (out, in) packed, or None (not a CPU matrix of a dtype it packs, or the GEMM not
        available)."""
        if not cls.available() or not cls.packs_dtype(weight.dtype) or weight.device.type != "cpu":
            return None
        if weight.dim() != 2:
            return None
        return cls.from_matrix(weight.detach().contiguous())

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can run through this packed weight."""
        return packable_input(x, self.in_features, self.dtype)


LibT = TypeVar("LibT")


class LibraryPackedWeight(PackedWeight, Generic[LibT]):
    """A packer whose layout and GEMM come from a library loaded once (MKL's pack API, the engine's
    native GEMM): available where that library loads."""

    @classmethod
    @abstractmethod
    def library(cls) -> LibT | None:
        """The library, or None where it does not load here."""

    @classmethod
    def available(cls) -> bool:
        return cls.library() is not None

    @classmethod
    def loaded(cls) -> LibT:
        """The library where :meth:`available` said it loads (a packed weight exists only there)."""
        lib = cls.library()
        assert lib is not None  # pack() asks available() first
        return lib
