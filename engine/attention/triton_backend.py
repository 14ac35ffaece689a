"""The ``triton`` attention backend: the KV store and paged-attention kernels behind the interface.

Where it sits: the model runner calls ``get_backend("triton")`` once and then, per layer and
step, ``store_kv`` and ``forward`` (see ``kvfleet.engine.attention.base`` for the shapes).
This module only checks shapes, devices and limits (cheaply: no device sync) and launches
the kernels of ``kvfleet.engine.kernels.triton``.

On a GPU the kernels are compiled. On the CPU they need Triton's interpreter, switched on
with ``TRITON_INTERPRET=1`` in the environment before the kernels are first imported; the
backend says so instead of failing inside Triton.
"""

from __future__ import annotations

from typing import Final

import torch

from kvfleet.engine.attention.base import AttentionMetadata, LayerKV
from kvfleet.engine.attention.checks import check_cache, check_forward
from kvfleet.engine.kernels.triton import kv_store, paged_attention

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
    check_cache(k_cache, v_cache)
    if k_cache.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {k_cache.shape[3]} exceeds the triton backend's limit {MAX_HEAD_DIM}")


class TritonAttentionBackend:
    name = "triton"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
        k_cache, v_cache = layer.k_cache, layer.v_cache
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

    def forward(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache, scale, sliding_window, sinks = layer
        _check_device(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        if sinks is not None:
            if sinks.shape != (q.shape[1],):
                raise ValueError(
                    f"sinks must be ({q.shape[1]},), one per query head, got {tuple(sinks.shape)}"
                )
            sinks = sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()
        _check_cache(k_cache, v_cache)
        check_forward(q, k_cache, meta, sliding_window)
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
            sinks,
        )
