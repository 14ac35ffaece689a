"""Shape and bounds checks for the attention backends that hand raw pointers to a kernel.

Where it sits: ``triton`` and ``cpu`` call these before launching their kernels, so a wrong
shape is a ValueError naming it, never a read outside a tensor. The shape checks cost no
device sync; :func:`check_paged_bounds` reads values, so only a CPU backend calls it.
"""

from __future__ import annotations

import torch

from kvfleet.engine.attention.base import AttentionMetadata


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be (num_blocks, block_size, num_kv_heads, head_dim), got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"v_cache must match k_cache in shape and strides: {tuple(v_cache.shape)} vs {tuple(k_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")


def check_forward(
    q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, sliding_window: int | None
) -> None:
    """The query, the metadata and the window fit the cache's heads and the step's sequences."""
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q must be (T, num_heads, {k_cache.shape[3]}), got {tuple(q.shape)}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if meta.query_start_loc.shape != (meta.num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be ({meta.num_seqs + 1},) for {meta.num_seqs} sequences, "
            f"got {tuple(meta.query_start_loc.shape)}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != meta.num_seqs:
        raise ValueError(
            f"block_tables must be ({meta.num_seqs}, max_blocks_per_seq), got {tuple(meta.block_tables.shape)}"
        )


def check_paged_bounds(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Every row, block id and key position the step names lies inside q and the cache (reads values)."""
    starts = meta.query_start_loc
    query_lens = starts[1:] - starts[:-1]
    if int(starts[0]) != 0 or int(starts[-1]) != q.shape[0] or bool((query_lens < 0).any()):
        raise ValueError(
            f"query_start_loc must rise from 0 to the {q.shape[0]} query rows, got {starts.tolist()[:8]}..."
        )
    if bool((query_lens > meta.seq_lens).any()) or bool((meta.seq_lens < 1).any()):
        raise ValueError("each sequence's seq_len must be at least 1 and cover its query rows")
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    width = meta.block_tables.shape[1] * block_size
    if meta.num_seqs and int(meta.seq_lens.max()) > width:
        raise ValueError(f"seq_len {int(meta.seq_lens.max())} exceeds its block table ({width} token slots)")
    if (
        meta.block_tables.numel()
        and not 0 <= int(meta.block_tables.min()) <= int(meta.block_tables.max()) < num_blocks
    ):
        raise ValueError(
            f"block_tables name blocks {int(meta.block_tables.min())}..{int(meta.block_tables.max())}, "
            f"the cache has 0..{num_blocks - 1}"
        )
