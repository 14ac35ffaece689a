"""The native CPU decode kernel (``csrc/paged_decode.c``), called through ctypes.

Where it sits: the ``cpu`` attention backend (``kvfleet.engine.attention.cpu_backend``) hands
it the decoding sequences of each step and layer. It reads every K and V row in place
through the block table, where the torch path first gathers the rows into a padded copy
and then runs SDPA over it: on a CPU, decode attention is memory-bound, so one pass over
the cache instead of three is most of the gain.

:func:`load_kernel` builds the native library (``build.py``: once per machine, cached on disk).
No compiler, or a failed build: :func:`load_kernel` gives no kernel and the reason, and the
``auto`` backend falls back to ``torch``.

Attention sinks (gpt-oss): a call with ``sinks`` (one float32 logit per query head) passes their
pointer as the kernel's last argument (NULL without).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, NamedTuple

import torch

from kvfleet.engine.kernels.native.build import FLAGS, build_library


class PagedCache(NamedTuple):
    """A layer's paged K/V and the step's block tables: what both attention kernels read."""

    k_cache: torch.Tensor  # (num_blocks, block_size, kv_heads, head_dim) float32
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (seqs, max_blocks) int32, rows contiguous
    seq_lens: torch.Tensor  # (seqs,) int32
    query_start_loc: torch.Tensor  # (seqs + 1,) int32


class PagedKernel:
    """A C attention kernel over the paged cache behind a typed call (``paged_decode_f32``,
    ``paged_prefill_f32``): both take the same arguments, the sinks' pointer (or NULL) last, and
    return a status, 0 for done."""

    def __init__(self, fn: Any) -> None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        fn.argtypes = [p, p, p, p, i64, p, p, p, i64, p, i32, i32, i32, i32, f32, i32, i32, p]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,
        paged: PagedCache,
        seqs: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Attend the query rows of the sequences in ``seqs`` (int64 indices) into ``out`` (with
        ``sinks``, (heads,) float32 contiguous: a logit per head joining its softmax)."""
        k_cache, v_cache, block_tables, seq_lens, query_start_loc = paged
        _, block_size, kv_heads, head_dim = k_cache.shape
        sinks_ptr = None
        if sinks is not None:
            if sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32 or not sinks.is_contiguous():
                raise ValueError(
                    f"sinks must be ({q.shape[1]},) float32 contiguous, got {tuple(sinks.shape)}"
                )
            sinks_ptr = sinks.data_ptr()
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
                sinks_ptr,
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


@functools.cache
def load_kernel() -> KernelBuild:
    """The kernel, built on first use (once per process; ``load_kernel.cache_clear()`` retries)."""
    return build_kernel(FLAGS)


def build_kernel(flags: tuple[str, ...]) -> KernelBuild:
    """The decode kernel of the library built with ``flags``."""
    lib, reason = build_library(flags)
    return KernelBuild(None, reason) if lib is None else KernelBuild(NativeDecode(lib))
