"""bf16 weights against float32 activations, in C (``csrc/bf16_gemm.c``): a bf16 model's linears on the CPU.

Where it sits: the bf16 method (``layers/linear/bf16.py``, a model served ``--dtype bfloat16`` on
the CPU) lays each linear's weight out once at load with :func:`pack_panels` (a
:class:`Bf16Weight`) and runs every step's matmul through :class:`NativeBf16`; the one-call decode
(``csrc/decode_layers.c``) reads the same panels as its ``BF16_PANELS`` operands. The kernel rounds
the float32 activations to bf16 at its input (as oneDNN's and llama.cpp's bf16 GEMMs do), takes
exact products and sums them in float32, and writes float32: the model's norms, residual stream and
KV cache stay float32. Paths (:data:`PATHS`): AMX-BF16 tiles, AVX512-BF16 ``vdpbf16ps`` and a
portable one (bf16 to float32 by a shift; AVX2 code on an AVX2 CPU), chosen per call by
:meth:`NativeBf16.path_for`: AMX from :data:`AMX_MIN_ROWS` rows where the process was granted the
tiles (``cpu_features.py``), AVX512-BF16 where the CPU lists it, else portable.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfleet.engine.kernels.native.build import library
from kvfleet.engine.kernels.native.cpu_features import CpuPaths, probe_cpu_paths

PATHS = ("portable", "avx512_bf16", "amx")  # bf16_gemm.c's path numbers, in order
PANEL = 16  # output columns per panel
KSTEP = 32  # k is padded to a multiple of this (one AMX tile row of bf16)
AMX_MIN_ROWS = 8  # decode_layers.c's BF16_AMX_MIN_ROWS: from here AMX tiles beat vdpbf16ps (even at 4 rows,
# 1.3-3.3x faster at 8 in bench/kernels/bf16_decode_micro.py on a loaded Xeon; vdpbf16ps ahead at 1-2)
BF16_NO_PATH, BF16_NO_MEMORY = -1, -3


class Bf16KernelError(RuntimeError):
    """The kernel refused its operands (a path this build or CPU lacks, or no memory)."""


@dataclass(frozen=True, slots=True)
class Bf16Weight:
    """A linear's (out, in) weight in bf16 panels (``csrc/bf16_gemm.c``'s layout): ``panels`` is
    (out padded to 16 / 16, in padded to 32 / 2, 16, 2) bf16; ``out_features``, ``in_features`` the
    real sizes."""

    panels: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * 2

    def dense(self) -> torch.Tensor:
        """The (out, in) bf16 weight the panels hold (tests, tensor-parallel cuts, the torch fallback)."""
        blocks, pairs = self.panels.shape[:2]
        w = self.panels.permute(0, 2, 1, 3).reshape(blocks * PANEL, pairs * 2)
        return w[: self.out_features, : self.in_features]


def pack_panels(weight: torch.Tensor) -> Bf16Weight:
    """``weight`` (out, in), any float dtype, rounded to bf16 and laid out in the kernel's panels:
    panels[b][p][c][e] = w[16 b + c][2 p + e], zeros past the real sizes."""
    n, k = weight.shape
    w = weight.detach().to(device="cpu", dtype=torch.bfloat16)
    padded = F.pad(w, (0, -k % KSTEP, 0, -n % PANEL))
    blocks, kp = padded.shape[0] // PANEL, padded.shape[1]
    panels = padded.reshape(blocks, PANEL, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
    return Bf16Weight(panels, n, k)


def choose_bf16_path(available: tuple[str, ...], cpu: CpuPaths) -> str:
    """The best path of this build that the CPU runs: ``cpu.bf16`` is the probe's (amx only where granted)."""
    wanted = {"amx": ("amx", "avx512_bf16"), "avx512_bf16": ("avx512_bf16",)}.get(cpu.bf16.path, ())
    return next((p for p in wanted if p in available), "portable")


class NativeBf16:
    """``bf16_linear`` behind a typed call; :attr:`path` the best path here (AMX only from
    :data:`AMX_MIN_ROWS` rows: :meth:`path_for`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = lib.bf16_linear
        self._fn.argtypes = [p, i64, i64, p, i64, p, p, i32, i32]
        self._fn.restype = i32
        lib.bf16_paths.restype = i32
        mask = int(lib.bf16_paths())
        self.paths = tuple(name for bit, name in enumerate(PATHS) if mask >> bit & 1)
        self.path = choose_bf16_path(self.paths, probe_cpu_paths())

    def path_for(self, rows: int) -> str:
        """The path a call of ``rows`` rows takes: below :data:`AMX_MIN_ROWS` AVX512-BF16 rather than AMX."""
        return "avx512_bf16" if self.path == "amx" and rows < AMX_MIN_ROWS else self.path

    def __call__(
        self, x: torch.Tensor, weight: Bf16Weight, bias: torch.Tensor | None = None, path: str | None = None
    ) -> torch.Tensor:
        """``x`` (m, k) float32 against ``weight``: (m, n) float32; ``path`` one of :attr:`paths`
        (default :meth:`path_for` the rows)."""
        x = x.contiguous()
        rows, k = x.shape
        if x.dtype != torch.float32 or k != weight.in_features:
            raise Bf16KernelError(f"x must be float32 with {weight.in_features} columns, got {x.dtype} {k}")
        chosen = path or self.path_for(rows)
        if chosen not in self.paths or (chosen == "amx" and self.path != "amx"):
            raise Bf16KernelError(
                f"path {chosen} does not run here (this build and CPU run up to {self.path})"
            )
        out = x.new_empty(rows, weight.out_features)
        rc = self._fn(
            x.data_ptr(),
            rows,
            k,
            weight.panels.data_ptr(),
            weight.out_features,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
            PATHS.index(chosen),
        )
        if rc != 0:
            raise Bf16KernelError(
                f"bf16_linear (k={k}): out of memory" if rc == BF16_NO_MEMORY else f"rc {rc}"
            )
        return out


@functools.cache
def load_bf16() -> NativeBf16 | None:
    """The native kernel, built on first use (None where the library does not build)."""
    lib = library()
    return None if lib is None else NativeBf16(lib)
