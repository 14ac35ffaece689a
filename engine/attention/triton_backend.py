"""The ``triton`` attention backend: the KV store and paged-attention kernels behind the interface.

Where it sits: the model runner calls ``get_backend("triton")`` once and then, per layer and
step, ``store_kv`` and ``forward`` (see ``kvfleet.engine.attention.base`` for the shapes).
This module only checks shapes, devices and limits (cheaply: no device sync) and launches
the kernels of ``kvfleet.engine.kernels``.

On a GPU the kernels are compiled. On the CPU they need Triton's interpreter, switched on
with ``TRITON_INTERPRET=1`` in the environment before the kernels are first imported; the
backend says so instead of failing inside Triton.
"""

from __future__ import annotations

from typing import Final

import torch

from kvfleet.engine.attention.base import AttentionMetadata, register_backend
from kvfleet.engine.kernels import kv_store, paged_attention

MAX_HEAD_DIM: Final[int] = 256


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"triton attention needs all tensors on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not paged_attention.INTERPRETED:
        raise RuntimeError(
            f"triton attention on {device.type} tensors needs TRITON_INTERPRET=1 in the environment "
            "before kvfleet.engine.kernels is imported (or a CUDA device)"
        )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
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
    if k_cache.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {k_cache.shape[3]} exceeds the triton backend's limit {MAX_HEAD_DIM}")


class TritonAttentionBackend:
    name = "triton"

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        _check_device(k, v, k_cache, v_cache, slot_mapping)
        _check_cache(k_cache, v_cache)
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
            raise ValueError(
                f"k and v must be (T, {k_cache.shape[2]}, {k_cache.shape[3]}) like the cache's heads, "
                f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
            )
        if slot_mapping.shape != (k.shape[0],):
            raise ValueError(f"slot_mapping must be ({k.shape[0]},), got {tuple(slot_mapping.shape)}")
        kv_store.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        _check_device(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        _check_cache(k_cache, v_cache)
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
        return paged_attention.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            sliding_window,
        )


register_backend("triton", TritonAttentionBackend)
