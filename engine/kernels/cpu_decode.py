"""The native CPU decode kernel (``csrc/paged_decode.c``): compiled once per machine, called through ctypes.

Where it sits: the ``cpu`` attention backend (``kvfleet.engine.attention.cpu_backend``) hands
it the decoding sequences of each step and layer. It reads every K and V row in place
through the block table, where the torch path first gathers the rows into a padded copy
and then runs SDPA over it: on a CPU, decode attention is memory-bound, so one pass over
the cache instead of three is most of the gain.

:func:`load_kernel` compiles the C source with the machine's C compiler (``$CC``, ``cc`` or
``gcc``; ``-O3 -march=native -fopenmp``) into ``$KVFLEET_CACHE/kernels`` (default
``~/.cache/kvfleet/kernels``), named by a hash of the source, the flags and the host CPU,
written under a temporary name and renamed, so concurrent processes never load half a file.
No compiler, or a failed build: :func:`load_kernel` gives no kernel and the reason, and the ``auto`` backend falls back to ``torch``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvfleet.engine.model.tiny import cache_root

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# Compiled into the same library: the fused element-wise ops that ``cpu_fused.py`` calls, the
# few-row matmul that ``cpu_linear.py`` calls, the packed-weight GEMM of ``native_packed.py``,
# the prefill attention of ``cpu_prefill.py`` and the all-layers decode step of ``decode_layers.py``.
SOURCES = (
    SOURCE,
    SOURCE.with_name("fused_ops.c"),
    SOURCE.with_name("skinny_gemm.c"),
    SOURCE.with_name("packed_gemm.c"),
    SOURCE.with_name("paged_prefill.c"),
    SOURCE.with_name("decode_layers.c"),
)
HEADERS = (SOURCE.with_name("fast_exp.h"),)  # included by the sources: part of the build key
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


class PagedKernel:
    """A C attention kernel over the paged cache behind a typed call (``paged_decode_f32``,
    ``paged_prefill_f32``): both take the same arguments and return a status, 0 for done."""

    def __init__(self, fn: Any) -> None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        fn.argtypes = [p, p, p, p, i64, p, p, p, i64, p, i32, i32, i32, i32, f32, i32, i32]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        seqs: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> None:
        """Attend the query rows of the sequences in ``seqs`` (int64 indices) into ``out``."""
        _, block_size, kv_heads, head_dim = k_cache.shape
        status = int(
            self._fn(
                q.data_ptr(),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                block_tables.data_ptr(),
                block_tables.stride(0),
                seq_lens.data_ptr(),
                query_start_loc.data_ptr(),
                seqs.data_ptr(),
                seqs.numel(),
                out.data_ptr(),
                q.shape[1],
                kv_heads,
                head_dim,
                block_size,
                scale,
                window or 0,
                torch.get_num_threads(),
            )
        )
        if status != 0:
            self.fail(status, q, k_cache, seq_lens)

    def fail(self, status: int, q: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Raise what a non-zero ``status`` of this kernel means."""
        raise RuntimeError(f"{self._fn.__name__} failed with status {status}")


class NativeDecode(PagedKernel):
    """``paged_decode_f32``: float32 CPU tensors in, the one query row of each listed sequence written."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib.paged_decode_f32)

    def fail(self, status: int, q: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor) -> None:
        raise MemoryError(f"the CPU decode kernel could not allocate scores for {int(seq_lens.max())} keys")


class KernelBuild(NamedTuple):
    """What a build gave: the kernel, or None and the reason (no compiler, the compiler's errors)."""

    kernel: NativeDecode | None
    reason: str | None = None


class LibraryBuild(NamedTuple):
    """The compiled library of all ``SOURCES``, or None and the reason."""

    library: ctypes.CDLL | None
    reason: str | None = None


@functools.cache
def load_kernel() -> KernelBuild:
    """The kernel, built on first use (once per process; ``load_kernel.cache_clear()`` retries)."""
    return build_kernel(FLAGS)


def build_kernel(flags: tuple[str, ...]) -> KernelBuild:
    """The decode kernel of the library built with ``flags``."""
    lib, reason = build_library(flags)
    return KernelBuild(None, reason) if lib is None else KernelBuild(NativeDecode(lib))


def build_library(flags: tuple[str, ...]) -> LibraryBuild:
    """The library built with ``flags``, cached on disk by sources, flags, compiler and CPU."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return LibraryBuild(None, "no C compiler (set CC, or install gcc)")
    target = _cache_dir() / f"paged_decode-{_build_key(compiler, flags)}.so"
    try:
        if target.exists():
            try:
                return LibraryBuild(ctypes.CDLL(str(target)))
            except OSError:  # a damaged file in the cache (a full disk, a copied home): build it again
                target.unlink(missing_ok=True)
        _compile(compiler, flags, target)
        return LibraryBuild(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as err:
        detail = err.stderr.strip() if isinstance(err, subprocess.CalledProcessError) else str(err)
        names = " and ".join(source.name for source in SOURCES)
        return LibraryBuild(None, f"building {names} with {compiler} failed: {detail}"[:2000])


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    """Source, flags, compiler and host CPU: -march=native code is only valid on the CPU it was built for."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS)))
    digest.update(" ".join((compiler, *flags, platform.machine(), _cpu_flags())).encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("flags", "Features", "model name"))]
    return "\n".join(sorted(set(lines)))


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
