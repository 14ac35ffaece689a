"""How tensor parallelism splits a Llama-family model over ranks (docs/architecture.md §4): pure, torch-free.

The engine's rule (``--tensor-parallel-size N``): query and KV heads split by whole GQA groups.
When N <= kv_heads any N works; the split may be uneven by whole KV-head groups (3 KV heads over
N=2: 2 + 1), and the biggest rank holds ceil(kv_heads / N) of them. When N > kv_heads, each KV
head is replicated N / kv_heads times, which needs N % kv_heads == 0, and the query heads split
evenly, which needs num_heads % N == 0. The MLP's intermediate features and the vocabulary split
in ceil(x / N) slices; the RMSNorms are replicated. :mod:`kvfleet.capacity` exports these.
"""

from __future__ import annotations

import math

from .catalog import ModelShape


def tp_split_error(num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why the engine cannot split ``num_heads`` query / ``num_kv_heads`` KV heads over ``tp`` ranks, or None."""
    if tp < 1:
        return f"tensor-parallel size must be at least 1, got {tp}"
    if tp <= num_kv_heads:
        return None
    if tp % num_kv_heads:
        return (
            f"tensor-parallel size {tp} exceeds the {num_kv_heads} KV heads and is not a multiple "
            f"of them (a KV head is replicated over tp / kv_heads ranks)"
        )
    if num_heads % tp:
        return f"tensor-parallel size {tp} does not divide the {num_heads} query heads"
    return None


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads on the biggest rank: ceil(kv_heads / tp), never below one (replicated when tp > kv_heads)."""
    return max(1, math.ceil(kv_heads / tp))


def q_heads_per_rank(num_heads: int, kv_heads: int, tp: int) -> int:
    """Query heads on the biggest rank: its KV heads' whole GQA groups, or num_heads / tp when KV heads replicate."""
    if tp <= kv_heads:
        return kv_heads_per_rank(kv_heads, tp) * (num_heads // kv_heads)
    return math.ceil(num_heads / tp)


def per_rank_params(shape: ModelShape, tp: int) -> int:
    """Parameters on the biggest of ``tp`` ranks; with tp = 1, exactly ``shape.num_params``.

    Per layer: q (column) and o (row) over the rank's query heads, k and v (column) over its KV
    heads, Qwen2's q/k/v biases likewise, gate/up (column) and down (row) over ceil(intermediate
    / tp) features, the RMSNorms whole (Gemma 3's four, q/k norms of one head); a sparse layer's
    every expert over ceil(expert intermediate / tp) features and its router whole; then the
    embedding and an untied lm_head over ceil(vocab / tp) rows (vocab-parallel), and the final norm
    whole. gpt-oss's biases and sinks as its weights are split (``engine/model/tp.py``).
    """
    h, d = shape.hidden_size, shape.head_dim
    q_width = q_heads_per_rank(shape.num_heads, shape.num_kv_heads, tp) * d
    kv_width = kv_heads_per_rank(shape.num_kv_heads, tp) * d
    attention = 2 * h * q_width + 2 * h * kv_width
    if shape.attention_bias:
        attention += q_width + 2 * kv_width
    # gpt-oss: o's bias whole (on rank 0), the sinks of the rank's heads
    attention += (h if shape.o_bias else 0) + (q_width // d if shape.attention_sinks else 0)
    mlp = 3 * h * math.ceil(shape.intermediate_size / tp)
    expert_columns = math.ceil(shape.expert_intermediate_size / tp)
    sparse = shape.num_experts * (3 * h * expert_columns + h)
    if shape.expert_biases:  # each expert's gate/up bias over its columns, down's whole; the router's
        sparse += shape.num_experts * (2 * expert_columns + h + 1)
    norms = (4 if shape.sandwich_norms else 2) * h + (2 * d if shape.qk_norm else 0)
    dense_layers = shape.num_layers - shape.sparse_layers
    layers = shape.num_layers * (attention + norms) + dense_layers * mlp + shape.sparse_layers * sparse
    vocab_rows = math.ceil(shape.vocab_size / tp)
    embeddings = vocab_rows * h * (1 if shape.tie_word_embeddings else 2)
    return layers + embeddings + h
