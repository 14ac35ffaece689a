"""What a model needs on one tensor-parallel rank, in bytes, and what a GPU gives it: weights, KV
cache per token, the activation reserve, the KV budget left and the blocks it holds, and the
bandwidth bound on decode; torch-free.
"""

from __future__ import annotations

import math

from .catalog import DTYPE_BYTES, GIB, GPUSpec, ModelShape, canonical_dtype
from .quant import per_rank_expert_bytes, per_rank_weight_bytes
from .tp import kv_heads_per_rank, q_heads_per_rank

# The share of a GPU's memory the engine keeps free for activations and the sampler
# (engine/runner/model_runner.py's CUDA_ACTIVATION_RESERVE); the reserve is this or the activation estimate,
# whichever is larger.
ENGINE_ACTIVATION_RESERVE = 0.05
# What a rank holds besides its weights before the engine measures its memory: the CUDA context,
# cuBLAS workspaces and, with N > 1, NCCL's buffers (vLLM counts these as "non-torch memory",
# 0.5 to 1.5 GiB per GPU). The operator predicts used memory as weights + this; the engine
# passes what it measured instead.
RANK_RUNTIME_OVERHEAD_BYTES = GIB


def kv_bytes_per_token(shape: ModelShape, dtype: str = "bfloat16") -> int:
    """K and V for one token in every layer: 2 × layers × kv_heads × head_dim × dtype bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[canonical_dtype(dtype)]


def weights_bytes(shape: ModelShape, dtype: str = "bfloat16") -> int:
    """Every parameter once, in ``dtype``."""
    return shape.num_params * DTYPE_BYTES[canonical_dtype(dtype)]


def per_rank_weights_bytes(shape: ModelShape, dtype: str, tp: int, quantization: str | None = None) -> int:
    """The weights of the biggest of ``tp`` ranks (:func:`per_rank_params`), in ``dtype``; the decoder
    linears in ``quantization``'s bytes per weight (:mod:`kvfleet.capacity.quant`)."""
    return per_rank_weight_bytes(shape, dtype, tp, quantization)


def per_rank_kv_bytes_per_token(shape: ModelShape, dtype: str, tp: int) -> int:
    """K and V of one token on one rank: 2 × layers × ceil(kv_heads / tp) × head_dim × dtype bytes."""
    heads = kv_heads_per_rank(shape.num_kv_heads, tp)
    return 2 * shape.num_layers * heads * shape.head_dim * DTYPE_BYTES[canonical_dtype(dtype)]


def per_rank_kv_bytes_per_sequence(
    shape: ModelShape, dtype: str, tp: int, context: int, block_size: int
) -> int:
    """KV of one sequence of ``context`` tokens on one rank, in whole blocks: the full-attention layers
    hold every token, the sliding ones only their window (plus the block the window starts in), as
    the engine's KV cache groups free the rest (engine/kv/groups.py): full layers × context + sliding
    layers × window, in a layer's bytes per token."""
    per_layer = per_rank_kv_bytes_per_token(shape, dtype, tp) // shape.num_layers
    full_tokens = blocks_for(context, block_size) * block_size
    window_tokens = full_tokens
    if shape.sliding_window is not None:
        window_tokens = min(full_tokens, (blocks_for(shape.sliding_window - 1, block_size) + 1) * block_size)
    sliding = shape.sliding_layers
    return per_layer * ((shape.num_layers - sliding) * full_tokens + sliding * window_tokens)


def activation_bytes(
    shape: ModelShape,
    dtype: str = "bfloat16",
    *,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    tp: int = 1,
) -> int:
    """Peak activation memory of one forward step on one rank (an estimate, as vLLM's profiling run measures).

    A step of T = ``max_num_batched_tokens`` tokens holds, in the activation dtype (a = dtype
    bytes, at least 2 since fp8/int8 weights compute in 16-bit):
      T × (2·hidden [residual + normed input, replicated] + (q_heads + 2·kv_heads per rank)·head_dim
           + 2·ceil(intermediate / tp) [gate and up of SwiGLU, column-parallel]) × a
    (a mixture of experts: the larger of that and top_k × (hidden + 2·ceil(expert intermediate / tp)),
    each token's row gathered once per expert it goes to)
    plus the fp32 logits of the rows sampled, gathered whole on every rank,
    L = min(T, ``max_num_seqs``): L × vocab × 4.
    """
    t, a = max_num_batched_tokens, max(2, DTYPE_BYTES[canonical_dtype(dtype)])
    heads = q_heads_per_rank(shape.num_heads, shape.num_kv_heads, tp)
    qkv = (heads + 2 * kv_heads_per_rank(shape.num_kv_heads, tp)) * shape.head_dim
    dense = 2 * math.ceil(shape.intermediate_size / tp) if shape.sparse_layers < shape.num_layers else 0
    # a sparse layer gathers each token's row once per expert it goes to: top-k rows of gate and up
    sparse = shape.experts_per_token * (
        shape.hidden_size + 2 * math.ceil(shape.expert_intermediate_size / tp)
    )
    per_token = 2 * shape.hidden_size + qkv + max(dense, sparse if shape.sparse_layers else 0)
    logits = min(t, max_num_seqs) * shape.vocab_size * 4
    return t * per_token * a + logits


def activation_reserve_bytes(
    shape: ModelShape,
    dtype: str,
    tp: int,
    gpu_memory_bytes: int,
    *,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
) -> int:
    """What a rank keeps free for one step's activations: the larger of the engine's fixed share
    (:data:`ENGINE_ACTIVATION_RESERVE` of the GPU) and :func:`activation_bytes` on that rank."""
    estimate = activation_bytes(
        shape, dtype, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, tp=tp
    )
    return max(int(gpu_memory_bytes * ENGINE_ACTIVATION_RESERVE), estimate)


def kv_cache_budget_bytes(
    gpu_memory_bytes: int, used_bytes: int, gpu_memory_utilization: float, activation_reserve: int
) -> int:
    """The bytes a rank may give its KV cache: int(total × utilisation) − activation reserve − used.

    ``used_bytes`` is what the rank holds already (weights, CUDA context): the engine measures
    it (total − free after loading); the operator predicts it. Negative when nothing is left.
    """
    return int(gpu_memory_bytes * gpu_memory_utilization) - activation_reserve - used_bytes


def kv_blocks(budget_bytes: int, block_bytes: int) -> int:
    """Whole KV blocks of ``block_bytes`` in ``budget_bytes`` (0 when the budget is not positive)."""
    return max(0, budget_bytes // block_bytes)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks one sequence of ``tokens`` tokens occupies."""
    return -(-tokens // block_size)


def decode_tokens_per_s_bound(
    shape: ModelShape,
    gpu: GPUSpec,
    *,
    num_gpus: int,
    context: int,
    batch_size: int,
    dtype: str = "bfloat16",
    quantization: str | None = None,
) -> float:
    """Memory-bandwidth roofline of decode: batch × one GPU's bandwidth ÷ bytes one rank reads per step.

    The ``num_gpus`` ranks read their shares in parallel; the biggest one bounds the step. One
    decode step at batch B reads that rank's weights once and its K/V heads of B sequences of
    ``context`` tokens: bytes = weights/rank + B × context × KV bytes/token/rank (a sliding layer reads
    only its window: :func:`per_rank_kv_bytes_per_sequence`); it yields B tokens.
    A mixture of experts reads only the experts its B tokens hit: with routing spread evenly,
    E × (1 − (1 − k/E)^B) of a layer's E experts (k per token), the others' bytes not read.
    """
    step_bytes = per_rank_weights_bytes(
        shape, dtype, num_gpus, quantization
    ) + batch_size * per_rank_kv_bytes_per_sequence(shape, dtype, num_gpus, context, 1)
    if shape.num_experts:
        unread = (1 - shape.experts_per_token / shape.num_experts) ** batch_size
        step_bytes -= int(per_rank_expert_bytes(shape, dtype, num_gpus, quantization) * unread)
    return batch_size * gpu.bandwidth_bytes_per_s / step_bytes
