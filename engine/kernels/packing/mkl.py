"""Weights packed once for MKL's GEMM: the prefill-sized matmuls of a float32 model on the CPU.

Where it sits: ``ModelRunner`` calls ``LlamaForCausalLM.prepack()`` after loading (when
``EngineConfig.prepack_weights``, and ``kernels/packing`` picks MKL over oneDNN: by
name, or for ``auto`` as the faster here); each layer then holds a :class:`PackedWeight` beside
its q/k/v, o_proj, gate/up and down_proj weights, and ``kernels/linear.py`` sends a step
of more than ``SKINNY_MAX_ROWS`` rows through it. Fewer rows (decode) stay on the native
few-row kernel, which reads the plain weight.

Why: torch's ``F.linear`` copies the whole weight into MKL's panel layout on every call
(``sgemm_scopy`` was 10% of a 476-row prefill forward under perf). ``cblas_sgemm_pack``
makes that copy once; ``cblas_sgemm_compute`` then runs the same kernels over it: the
output equals ``F.linear``'s up to float32 summation order (tested; on SmolLM2's shapes at
2 threads the model's logits came out bit for bit the same). Measured on SmolLM2's 30 layers of
linears, interleaved, 2 threads (bench/results/prepacked_linear.txt): 0.66x the time at 8
rows, 0.71x at 64, 0.91x at 476, 0.96x at 2048.

Memory: MKL asks for 3-9x the weight's bytes for these shapes but writes about 1x; the
rest of the allocation is never touched, so it stays virtual. Resident cost: about one
more copy of the linears' weights. The symbols come from torch's own MKL
(``libtorch_cpu``); a torch build without them (aarch64, macOS) packs nothing and runs
``F.linear`` as before.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvfleet.engine.kernels.packing.base import LibraryPackedWeight

# CBLAS enum values (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
# The row count the packing is tuned for: results hold for any row count (tested).
_PACK_ROWS_HINT = 512


class _Mkl:
    """The three CBLAS pack entry points behind typed ctypes calls."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i, f, p, size = ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_size_t
        self.get_size = lib.cblas_sgemm_pack_get_size
        self.get_size.argtypes, self.get_size.restype = [i, i, i, i], size
        self.pack = lib.cblas_sgemm_pack
        self.pack.argtypes, self.pack.restype = [i, i, i, i, i, i, f, p, i, p], None
        self.compute = lib.cblas_sgemm_compute
        self.compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
        self.compute.restype = None


@functools.cache
def _mkl() -> _Mkl | None:
    """torch's MKL pack API, or None where this torch build does not export it."""
    lib_path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return _Mkl(ctypes.CDLL(str(lib_path)))
    except (OSError, AttributeError):
        return None


class MklPackedWeight(LibraryPackedWeight[_Mkl]):
    """A linear's (out, in) weight, packed as the right operand of ``x @ weight.T``; MKL's GEMM walks
    panels, so the few-row kernel streams a decode step faster (``streams_few_rows`` False)."""

    def __init__(self, buffer: torch.Tensor, out_features: int, in_features: int) -> None:
        super().__init__(out_features, in_features)
        self.buffer = buffer  # uint8, MKL's opaque layout

    @classmethod
    def library(cls) -> _Mkl | None:
        return _mkl()

    @classmethod
    def from_matrix(cls, source: torch.Tensor) -> MklPackedWeight:
        mkl = cls.loaded()
        n, k = source.shape
        buffer = torch.empty(mkl.get_size(_B_MATRIX, _PACK_ROWS_HINT, n, k), dtype=torch.uint8)
        mkl.pack(
            _ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS_HINT, n, k, 1.0, source.data_ptr(), k, buffer.data_ptr()
        )
        return cls(buffer, n, k)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        mkl = self.loaded()
        rows, n, k = x.shape[0], self.out_features, self.in_features
        out = x.new_empty(rows, n)
        mkl.compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, rows, n, k,
            x.data_ptr(), k, self.buffer.data_ptr(), k, 0.0, out.data_ptr(), n,
        )  # fmt: skip
        if bias is not None:
            out += bias
        return out
