"""Per-channel int8 weights against per-token int8 activations, in C (``csrc/int8_gemm.c``).

Where it sits: the int8 method (``layers/linear/int8.py``: ``--quantization int8``, and compressed-tensors
W8A8 checkpoints) stores each linear as an :class:`Int8Weight` — int8 (out, in) and one float32
scale per output row — and resolves it with ``kernels/int8_linear.py``'s ``resolve_int8_linear``,
whose callable calls :class:`NativeInt8` on every step. The kernel quantises each token's activations to int8 with
its own scale (amax / 127), takes exact int32 dots and scales them by both scales, on the AVX-512
VNNI path where the CPU has it (``csrc/int8_vnni.c``), else AVX2, else portable C.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kvfleet.engine.kernels.native.build import bind
from kvfleet.engine.kernels.native.cpu_features import probe_cpu_paths
from kvfleet.engine.kernels.native.quant_gemm import PATHS, choose_path
from kvfleet.engine.kernels.row_scaled import RowScaledWeight


class Int8KernelError(RuntimeError):
    """The kernel refused its operands, or an :class:`Int8Weight` is malformed."""


@dataclass(frozen=True, slots=True)
class Int8Weight(RowScaledWeight):
    """A linear's weight as ``qweight`` (out, in) int8 and ``scale`` (out,) float32: w = scale * q."""

    def __post_init__(self) -> None:
        if self.qweight.dtype != torch.int8 or self.qweight.dim() != 2 or not self.qweight.is_contiguous():
            raise Int8KernelError("int8 weights must be a contiguous 2-d int8 tensor")
        self.check_scale(Int8KernelError)

    def dequantised(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]


def quantize_per_channel(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-row int8: scale = amax / 127 (1 for an all-zero row), q = round(w / scale)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


class NativeInt8:
    """``int8_linear`` behind a typed call, on the path chosen once per process (:func:`choose_path`:
    AVX-512 VNNI where ``native/cpu_features.py`` finds it, else AVX2, else portable C)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = lib.int8_linear
        self._fn.argtypes = [p, i64, i64, p, i64, p, p, p, i32, i32]
        self._fn.restype = i32
        lib.int8_paths.restype = i32
        mask = int(lib.int8_paths())
        self.paths = tuple(name for bit, name in enumerate(PATHS) if mask >> bit & 1)
        self.path = choose_path(self.paths, probe_cpu_paths())

    def __call__(
        self, x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None, path: str | None = None
    ) -> torch.Tensor:
        """``x`` (m, k) float32 against ``weight``: (m, n) float32; ``path`` one of :attr:`paths`
        (default :attr:`path`)."""
        x = x.contiguous()
        rows, k = x.shape
        if k != weight.in_features:
            raise Int8KernelError(f"x has {k} columns, the weight {weight.in_features}")
        chosen = path or self.path
        if chosen not in self.paths:
            raise Int8KernelError(f"path {chosen} does not run here (this build and CPU run {self.paths})")
        out = x.new_empty(rows, weight.out_features)
        bias_ptr = None if bias is None else bias.data_ptr()
        rc = self._fn(
            x.data_ptr(),
            rows,
            k,
            weight.qweight.data_ptr(),
            weight.out_features,
            weight.scale.data_ptr(),
            bias_ptr,
            out.data_ptr(),
            torch.get_num_threads(),
            PATHS.index(chosen),
        )
        if rc != 0:
            raise Int8KernelError(f"int8_linear (k={k}): out of memory" if rc == -3 else f"int8_linear: {rc}")
        return out


@functools.cache
def load_int8() -> NativeInt8 | None:
    """The native kernel, built on first use (None where the library does not build)."""
    return bind(NativeInt8)
