"""The native CPU prefill attention (``csrc/paged_prefill.c``): prompt chunks read in place from the paged cache.

Where it sits: the ``cpu`` attention backend (``engine/attention/cpu_backend.py``) hands it the
sequences of a step with more than one query row; the decode rows go to
:mod:`kvfleet.engine.kernels.native.paged_decode`'s kernel, built into the same library. It replaces the
torch path's gather of each chunk's K/V rows into a padded copy and its per-tile SDPA calls: the
kernel walks each sequence's block table, skips every key past a row's own position, and runs
the G query heads of a KV head together, flash-style (``csrc/paged_prefill.c`` says how).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvfleet.engine.kernels.native.build import library
from kvfleet.engine.kernels.native.paged_decode import PagedKernel

# What paged_prefill_f32 takes (the C file's own check returns 2 otherwise).
MAX_HEAD_DIM = 256
MAX_QUERIES_PER_KV = 16


def prefill_ok(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this attention geometry."""
    return (
        head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_QUERIES_PER_KV
    )


class NativePrefill(PagedKernel):
    """``paged_prefill_f32``: float32 CPU tensors in, every query row of the listed sequences written."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib.paged_prefill_f32)
        lib.paged_prefill_preferred.restype = ctypes.c_int
        # built with AVX-512 or AVX2: the builds measured faster than SDPA (the C file says by how much)
        self.preferred = bool(lib.paged_prefill_preferred())

    def fail(self, status: int, q: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor) -> None:
        if status == 1:
            raise MemoryError("the CPU prefill kernel could not allocate its scratch buffers")
        kv_heads, head_dim = k_cache.shape[2:]
        raise ValueError(
            f"the CPU prefill kernel does not take {q.shape[1]} heads over {kv_heads} KV heads of size "
            f"{head_dim} (check prefill_ok first)"
        )


@functools.cache
def load_prefill() -> NativePrefill | None:
    """The native kernel, built on first use (None where the library does not build)."""
    lib = library()
    return None if lib is None else NativePrefill(lib)
