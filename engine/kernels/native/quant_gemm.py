"""The quantised matmul in C (``csrc/quant_gemm.c``): activations against GGUF blocks repacked at load.

Where it sits: a model served with ``--quantization gguf`` (``engine/loader/gguf_loader.py``) reads
each linear's weight as the .gguf file's block rows (:class:`QuantWeight`);
``kernels/quant_linear.py`` repacks them once (:meth:`NativeQuant.pack`, ``csrc/quant_pack.c``:
16 output rows interleaved per 4 values, the layout of ``csrc/quant_layout.h``) into a
:class:`PackedQuant`, the only copy kept, and calls :meth:`NativeQuant.__call__` on every step. The
kernel quantises the activations to int8 per 32 once per call (llama.cpp's Q8_0/Q8_1 activations)
and dots them with 8 or 16 weight rows per pass, on the path chosen once per process
(:func:`choose_path`: AVX-512 VNNI where ``native/cpu_features.py`` finds it, else AVX2, else the
portable C path; the tests run each path the CPU has against the same reference).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch

from kvfleet.engine.kernels.native.build import bind
from kvfleet.engine.kernels.native.cpu_features import CpuPaths, probe_cpu_paths

# ggml type id -> (elements per block, bytes per block), the layouts of ggml-common.h
BLOCK_LAYOUTS: dict[int, tuple[int, int]] = {
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}
PATHS = ("portable", "avx2", "avx512_vnni")  # quant_linear's path numbers 0, 1, 2
_ERRORS = {
    -1: "a type the kernel does not handle",
    -2: "k not a whole number of blocks",
    -3: "out of memory",
    -4: "a path this build or CPU does not run",
}


class QuantKernelError(RuntimeError):
    """The kernel refused its operands (a type, a shape or a path it does not take)."""


def check_quant_status(rc: int, what: str) -> None:
    """Raise :class:`QuantKernelError` naming ``what`` and the kernel's status ``rc`` (0: nothing)."""
    if rc != 0:
        raise QuantKernelError(f"{what}: {_ERRORS.get(rc, rc)}")


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A linear's weight as the file's GGUF blocks: ``blocks`` (out, row bytes) uint8, ``ggml_type``
    its format, ``in_features`` the dequantised row length."""

    blocks: torch.Tensor
    ggml_type: int
    in_features: int

    def __post_init__(self) -> None:
        if self.ggml_type not in BLOCK_LAYOUTS:
            raise QuantKernelError(f"ggml type {self.ggml_type} has no quantised kernel")
        per_block, size = BLOCK_LAYOUTS[self.ggml_type]
        if self.in_features % per_block or self.blocks.shape[1] != self.in_features // per_block * size:
            raise QuantKernelError(
                f"rows of {self.blocks.shape[1]} bytes are not {self.in_features} values of type {self.ggml_type}"
            )
        if self.blocks.dtype != torch.uint8 or not self.blocks.is_contiguous():
            raise QuantKernelError("quantised blocks must be contiguous uint8")

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The file's blocks of rows ``ids``: (len, row bytes) uint8."""
        return self.blocks[ids]


@dataclass(frozen=True, slots=True)
class PackedQuant:
    """A :class:`QuantWeight` repacked for the kernel (``csrc/quant_layout.h``): ``data`` uint8."""

    data: torch.Tensor
    ggml_type: int
    out_features: int
    in_features: int
    native: NativeQuant = field(repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The file's blocks of rows ``ids`` again (exact): (len, row bytes) uint8."""
        return self.native.unpack_rows(self, ids)


class NativeQuant:
    """``quant_repack``, ``quant_unpack_rows`` and ``quant_linear`` behind typed calls."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._linear = lib.quant_linear
        self._linear.argtypes = [p, i64, i64, p, i64, i32, p, p, i32, i32]
        self._repack, self._unpack, self._size = (
            lib.quant_repack,
            lib.quant_unpack_rows,
            lib.quant_packed_size,
        )
        self._repack.argtypes = [p, i64, i64, i32, p]
        self._unpack.argtypes = [p, i64, i32, p, i64, p]
        self._size.argtypes = [i32, i64, i64, ctypes.POINTER(i64)]
        for fn in (self._linear, self._repack, self._unpack, self._size, lib.quant_paths):
            fn.restype = i32
        mask = int(lib.quant_paths())
        self.paths = tuple(name for bit, name in enumerate(PATHS) if mask >> bit & 1)
        self.path = choose_path(self.paths, probe_cpu_paths())

    @property
    def path(self) -> str:
        """The path every call runs unless told otherwise (``choose_path``'s, at start)."""
        return PATHS[self._number]

    @path.setter
    def path(self, name: str) -> None:
        if name not in self.paths:
            raise QuantKernelError(f"path {name} does not run here (this build and CPU run {self.paths})")
        self._number = PATHS.index(name)

    def pack(self, weight: QuantWeight) -> PackedQuant:
        """``weight``'s rows repacked in groups of 16 (one new tensor; ``weight`` may then be dropped)."""
        n, k, t = weight.out_features, weight.in_features, weight.ggml_type
        size = ctypes.c_int64()
        check_quant_status(self._size(t, n, k, ctypes.byref(size)), f"packing type {t}, k={k}")
        data = torch.empty(size.value, dtype=torch.uint8)
        check_quant_status(
            self._repack(weight.blocks.data_ptr(), n, k, t, data.data_ptr()), f"packing type {t}, k={k}"
        )
        return PackedQuant(data, t, n, k, self)

    def unpack_rows(self, packed: PackedQuant, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``packed`` as the file's blocks: (len, row bytes) uint8."""
        rows = ids.reshape(-1).to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= packed.out_features):
            raise IndexError(f"rows outside 0..{packed.out_features - 1}")
        per_block, size = BLOCK_LAYOUTS[packed.ggml_type]
        out = torch.empty(rows.numel(), packed.in_features // per_block * size, dtype=torch.uint8)
        rc = self._unpack(
            packed.data.data_ptr(),
            packed.in_features,
            packed.ggml_type,
            rows.data_ptr(),
            rows.numel(),
            out.data_ptr(),
        )
        check_quant_status(rc, f"unpacking type {packed.ggml_type}")
        return out

    def __call__(
        self, x: torch.Tensor, weight: PackedQuant, bias: torch.Tensor | None = None, path: str | None = None
    ) -> torch.Tensor:
        """``x`` (m, k) float32 against ``weight``: (m, out); ``path`` one of :attr:`paths` (default the chosen)."""
        x = x.contiguous()
        rows, k = x.shape
        out = x.new_empty(rows, weight.out_features)
        bias_ptr = None if bias is None else bias.data_ptr()
        number = PATHS.index(path) if path else self._number
        rc = self._linear(
            x.data_ptr(),
            rows,
            k,
            weight.data.data_ptr(),
            weight.out_features,
            weight.ggml_type,
            bias_ptr,
            out.data_ptr(),
            torch.get_num_threads(),
            number,
        )
        check_quant_status(rc, f"quant_linear (type {weight.ggml_type}, k={k}, path {PATHS[number]})")
        return out


def choose_path(built: tuple[str, ...], cpu: CpuPaths) -> str:
    """The fastest path both the library runs here (``built``) and the CPU's probed tier allows."""
    if cpu.isa == "avx512_vnni" and "avx512_vnni" in built:
        return "avx512_vnni"
    if cpu.isa != "portable" and "avx2" in built:
        return "avx2"
    return "portable"


@functools.cache
def load_quant() -> NativeQuant | None:
    """The native kernel, built on first use (None where the library does not build)."""
    return bind(NativeQuant)


def cpu_paths_line() -> str:
    """The start-up line: the quantised kernels' chosen path (avx512_vnni, avx2 or portable) and what
    the CPU offers."""
    native = load_quant()
    kernels = "not built" if native is None else native.path
    return probe_cpu_paths().describe(kernels)
