"""The reference attention backend in plain torch: the CPU default and the Triton kernels' oracle.

It gathers each sequence's keys and values from the paged cache through its block table
and runs causal attention with grouped-query heads. Clear rather than fast.
"""

from __future__ import annotations

import torch

from kvfleet.engine.attention.base import AttentionMetadata, register_backend


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    # Invariant: row i of sequence s attends exactly keys 0..(seq_len - query_len + i).
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for s, seq_len in enumerate(meta.seq_lens.tolist()):
        q_s = q[starts[s] : starts[s + 1]]  # (L, H, D)
        query_len = q_s.shape[0]
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[s, :n_blocks].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len]
        values = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len]
        keys = keys.repeat_interleave(group, dim=1).float()  # (K, H, D)
        values = values.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q_s.float(), keys) * scale
        positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] > positions[:, None]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[s] : starts[s + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


class TorchAttentionBackend:
    name = "torch"

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)


register_backend("torch", TorchAttentionBackend)
