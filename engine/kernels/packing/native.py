"""The ``native`` packer: weights packed once into column panels for the engine's own GEMM
(``native/packed_gemm.py``, ``csrc/packed_gemm.c``): one of the three packers of ``packing``.

Where it sits: :data:`kvfleet.engine.kernels.packing.PACKERS` registers it beside ``mkl`` and
``onednn``; ``auto`` times them all at load and keeps the fastest. It is the one packer that
streams a decode step's few rows as fast as the few-row kernel, so a linear packed here runs
every row count through it; the one-call decode (``native/decode_layers.py``) reads its panels.
"""

from __future__ import annotations

import torch

from kvfleet.engine.kernels.native.packed_gemm import PackedGemm, load_packed_gemm
from kvfleet.engine.kernels.packing.base import LibraryPackedWeight


class NativePackedWeight(LibraryPackedWeight[PackedGemm]):
    """A linear's (out, in) weight as panels of :data:`PANEL_COLUMNS` output columns, k-major.

    ``streams_few_rows``: one row streams each panel at the memory's pace (prefetched 1 KB ahead):
    SmolLM2's 121 matmuls a pass against the few-row kernel, 2 threads: 1-6 rows 18-21 against
    19-24 ms, 8 rows level (27-28), 12-16 rows 30-39 against 37-50."""

    streams_few_rows = True

    def __init__(self, panels: torch.Tensor, out_features: int, in_features: int) -> None:
        super().__init__(out_features, in_features)
        self.panels = panels  # float32, (ceil(out / 16) * 16 * in,)

    @classmethod
    def library(cls) -> PackedGemm | None:
        """The native library, where it builds here (a C compiler and OpenMP)."""
        return load_packed_gemm()

    @classmethod
    def from_matrix(cls, source: torch.Tensor) -> NativePackedWeight:
        native = cls.loaded()
        n, k = source.shape
        panels = torch.empty(native.size(n, k), dtype=torch.float32)
        native.pack(source.data_ptr(), n, k, panels.data_ptr())
        return cls(panels, n, k)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        native = self.loaded()
        rows, n, k = x.shape[0], self.out_features, self.in_features
        out = x.new_empty(rows, n)
        b = None if bias is None else bias.to(torch.float32).contiguous()
        native.linear(
            x.data_ptr(),
            rows,
            k,
            self.panels.data_ptr(),
            n,
            None if b is None else b.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out
