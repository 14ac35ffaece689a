"""The reference attention backend in plain torch: the CPU default and the Triton kernels' oracle.

It gathers each sequence's keys and values from the paged cache through its block table
and runs causal attention with grouped-query heads. Clear rather than fast:
``paged_attention_reference`` loops over the sequences (the Triton kernels' oracle); the
backend runs the same maths with all decoding sequences (one query row each) in one
batched call, so a CPU decode step costs a few tensor ops rather than a few per sequence.
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


def _attend_one(
    q_s: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One sequence's query rows (L, H, D) against its first ``seq_len`` cached keys, causally
    (and only the last ``window`` keys up to each row's position, when a window is given)."""
    num_heads, num_kv_heads = q_s.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    query_len = q_s.shape[0]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = table[:n_blocks].long()
    keys = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len]
    values = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len]
    keys = keys.repeat_interleave(group, dim=1).float()  # (K, H, D)
    values = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q_s.float(), keys) * scale
    positions = torch.arange(seq_len - query_len, seq_len, device=q_s.device)
    key_pos = torch.arange(seq_len, device=q_s.device)[None, :]
    mask = key_pos > positions[:, None]
    if window is not None:
        mask |= key_pos <= positions[:, None] - window
    scores.masked_fill_(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values).to(q_s.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    # Invariant: row i of sequence s at position p = seq_len - query_len + i attends exactly
    # keys 0..p, or max(0, p - window + 1)..p with a window.
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for s, seq_len in enumerate(meta.seq_lens.tolist()):
        rows = slice(starts[s], starts[s + 1])
        out[rows] = _attend_one(q[rows], k_cache, v_cache, meta.block_tables[s], seq_len, scale, window)
    return out


def decode_attention_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """All sequences with one query row at once: (S, H, D) rows against keys padded to the longest.

    Invariant: the one row of sequence s attends keys 0..seq_len[s]-1 (with a window, only
    seq_len[s]-window..seq_len[s]-1); padded key slots (past seq_len, or from the padding
    block 0 of a shorter table) and keys before the window are masked out before the softmax.
    """
    num_seqs, num_heads = q.shape[0], q.shape[1]
    num_kv_heads, head_dim, block_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    lens = meta.seq_lens.long()
    n_blocks = (int(meta.max_seq_len) + block_size - 1) // block_size
    tables = meta.block_tables[:, :n_blocks].long()
    keys = k_cache[tables].reshape(num_seqs, n_blocks * block_size, num_kv_heads, head_dim).float()
    values = v_cache[tables].reshape(num_seqs, n_blocks * block_size, num_kv_heads, head_dim).float()
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("skgd,slkd->skgl", qg, keys) * scale
    key_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
    pad = key_pos >= lens[:, None]
    if window is not None:
        pad |= key_pos < lens[:, None] - window
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    out = torch.einsum("skgl,slkd->skgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_attention_grouped(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The reference's result, with every decoding sequence (one query row) in one batched call."""
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    decode = (query_lens == 1).nonzero().flatten()
    if decode.numel() < 2:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, window)
    out = torch.empty_like(q)
    rows = meta.query_start_loc[decode].long()
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[:0],
        block_tables=meta.block_tables[decode],
        seq_lens=meta.seq_lens[decode],
        query_start_loc=torch.arange(decode.numel() + 1, dtype=torch.int32, device=q.device),
        max_query_len=1,
        max_seq_len=int(meta.seq_lens[decode].max()),
    )
    out[rows] = decode_attention_batched(q[rows], k_cache, v_cache, sub, scale, window)
    starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for s in (query_lens != 1).nonzero().flatten().tolist():
        span = slice(starts[s], starts[s + 1])
        out[span] = _attend_one(q[span], k_cache, v_cache, meta.block_tables[s], lens[s], scale, window)
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
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return paged_attention_grouped(q, k_cache, v_cache, meta, scale, sliding_window)


register_backend("torch", TorchAttentionBackend)
