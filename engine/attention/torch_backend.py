"""The reference attention backend in plain torch: the oracle of the Triton and native CPU kernels.

It gathers each sequence's keys and values from the paged cache through its block table
and runs causal attention with grouped-query heads. ``paged_attention_reference`` loops
over the sequences, clear rather than fast: it is the oracle of the Triton kernels and of
the backend itself, which runs the same maths with the step's sequences grouped into a
few padded ``scaled_dot_product_attention`` calls (``torch_batched.py``), so a CPU step
costs a few tensor ops per layer rather than a few per sequence.
"""

from __future__ import annotations

import torch

from kvfleet.engine.attention.base import AttentionMetadata, LayerKV
from kvfleet.engine.attention.torch_batched import BatchedAttention


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's query rows (L, H, D) against its first ``seq_len`` cached keys, causally
    (and only the last ``window`` keys up to each row's position, when a window is given; each
    head's ``sinks`` logit joining its softmax, when given)."""
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
    if sinks is not None:  # one more logit per head, dropped after the softmax (it has no value)
        sink = sinks.float()[:, None, None].expand(-1, query_len, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values).to(q_s.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # Invariant: row i of sequence s at position p = seq_len - query_len + i attends exactly
    # keys 0..p, or max(0, p - window + 1)..p with a window; a head's sink only joins its softmax.
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for s, seq_len in enumerate(meta.seq_lens.tolist()):
        rows = slice(starts[s], starts[s + 1])
        out[rows] = _attend_one(
            q[rows], k_cache, v_cache, meta.block_tables[s], seq_len, scale, window, sinks
        )
    return out


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._batched = BatchedAttention()

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
        store_kv_reference(k, v, layer.k_cache, layer.v_cache, slot_mapping)

    def forward(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        return self._batched.forward(q, layer, meta)
