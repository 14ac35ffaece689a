"""The native CPU prefill attention (``csrc/paged_prefill.c``): prompt chunks read in place from the paged cache.

Where it sits: the ``cpu`` attention backend (``engine/attention/cpu_backend.py``) hands it the
sequences of a step with more than one query row; the decode rows go to
:mod:`kvfleet.engine.kernels.cpu_decode`'s kernel, built into the same library. It replaces the
torch path's gather of each chunk's K/V rows into a padded copy and its per-tile SDPA calls: the
kernel walks each sequence's block table, skips every key past a row's own position, and runs
the G query heads of a KV head together, flash-style (``csrc/paged_prefill.c`` says how).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvfleet.engine.kernels.cpu_decode import FLAGS, build_library

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


class NativePrefill:
    """``paged_prefill_f32`` behind a typed call: float32 CPU tensors in, the listed sequences' rows of ``out`` written."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_prefill_f32
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
        """Causal attention of every query row of the sequences in ``seqs`` (int64 indices) into ``out``."""
        _, block_size, kv_heads, head_dim = k_cache.shape
        heads = q.shape[1]
        status = self._fn(
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
            heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            window or 0,
            torch.get_num_threads(),
        )
        if status == 1:
            raise MemoryError("the CPU prefill kernel could not allocate its scratch buffers")
        if status != 0:
            raise ValueError(
                f"the CPU prefill kernel does not take {heads} heads over {kv_heads} KV heads of size "
                f"{head_dim} (check prefill_ok first)"
            )


@functools.cache
def load_prefill() -> NativePrefill | None:
    """The native kernel, built on first use (None where the library does not build)."""
    lib = build_library(FLAGS).library
    return None if lib is None else NativePrefill(lib)
