"""Capacity maths (docs/architecture.md §4): what fits on which GPUs, per tensor-parallel rank, torch-free.

Shared by ``kvfleet plan`` (the table a user reads before buying GPUs), the engine's
simulated mode (decode cost per step), the operator (the capacity figures and the
``CapacityFits`` condition of an InferenceService's status) and the engine itself, which
calls :func:`check_engine_fits` before it allocates its KV cache: one verdict, so the
operator never says "fits" for a model the engine refuses to load. It reads a model's shape
and a GPU from :mod:`kvfleet.capacity_catalog` (re-exported here); it never loads weights.

Tensor parallelism (``--tensor-parallel-size N``, one engine pod with N GPUs) splits a model
the way the engine shards it: the column-parallel linears (q, k, v, gate, up) and the
row-parallel ones (o, down) by output or input features, the embedding and lm_head by
vocabulary rows, the RMSNorms replicated; attention by whole GQA groups, so each rank holds
ceil(kv_heads / N) KV heads (a KV head is replicated when N > kv_heads). Every figure is of
the biggest rank, which is the one that runs out of memory first.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .capacity_catalog import (  # noqa: F401  (re-exported: callers import the catalogue from here)
    DTYPE_BYTES,
    GIB,
    GPUS,
    KNOWN_MODELS,
    CapacityError,
    GPUSpec,
    ModelShape,
    UnknownDtypeError,
    UnknownGPUError,
    UnknownModelError,
    canonical_dtype,
    model_shape_from_config,
    resolve_gpu,
    resolve_model,
)
from .capacity_quant import WEIGHT_FORMATS, canonical_quantization, per_rank_weight_bytes  # noqa: F401
from .capacity_tp import (  # noqa: F401  (re-exported)
    kv_heads_per_rank,
    per_rank_params,
    q_heads_per_rank,
    tp_split_error,
)

# The share of a GPU's memory the engine keeps free for activations and the sampler
# (engine/runner.py's CUDA_ACTIVATION_RESERVE); the reserve is this or the activation estimate,
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
    linears in ``quantization``'s bytes per weight (:mod:`kvfleet.capacity_quant`)."""
    return per_rank_weight_bytes(shape, dtype, tp, quantization)


def per_rank_kv_bytes_per_token(shape: ModelShape, dtype: str, tp: int) -> int:
    """K and V of one token on one rank: 2 × layers × ceil(kv_heads / tp) × head_dim × dtype bytes."""
    heads = kv_heads_per_rank(shape.num_kv_heads, tp)
    return 2 * shape.num_layers * heads * shape.head_dim * DTYPE_BYTES[canonical_dtype(dtype)]


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
    plus the fp32 logits of the rows sampled, gathered whole on every rank,
    L = min(T, ``max_num_seqs``): L × vocab × 4.
    """
    t, a = max_num_batched_tokens, max(2, DTYPE_BYTES[canonical_dtype(dtype)])
    heads = q_heads_per_rank(shape.num_heads, shape.num_kv_heads, tp)
    qkv = (heads + 2 * kv_heads_per_rank(shape.num_kv_heads, tp)) * shape.head_dim
    per_token = 2 * shape.hidden_size + qkv + 2 * math.ceil(shape.intermediate_size / tp)
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
    ``context`` tokens: bytes = weights/rank + B × context × KV bytes/token/rank; it yields B tokens.
    """
    step_bytes = per_rank_weights_bytes(
        shape, dtype, num_gpus, quantization
    ) + batch_size * context * per_rank_kv_bytes_per_token(shape, dtype, num_gpus)
    return batch_size * gpu.bandwidth_bytes_per_s / step_bytes


@dataclass(frozen=True)
class FitVerdict:
    """Whether the engine can load a model on ``tensor_parallel_size`` GPUs, and the figures of its biggest rank.

    ``fits`` is False with a ``reason`` when the heads do not split over the ranks, when the
    weights, overhead and activation reserve leave no KV budget, or when the KV blocks left hold
    less than one sequence of ``max_model_len`` tokens. All byte figures are per rank (one GPU).
    """

    fits: bool
    reason: str | None
    tensor_parallel_size: int
    weights_bytes_per_rank: int
    used_bytes_per_rank: int
    kv_heads_per_rank: int
    kv_bytes_per_token_per_rank: int
    activation_reserve_bytes: int
    usable_bytes_per_rank: int
    kv_cache_bytes_per_rank: int
    num_kv_blocks: int
    kv_tokens: int
    max_concurrent_sequences: int


def _check_inputs(
    tp: int, gpu_memory_bytes: int, utilization: float, max_model_len: int, block_size: int
) -> None:
    for field, value in (
        ("tensor-parallel size", tp),
        ("max_model_len", max_model_len),
        ("block_size", block_size),
    ):
        if value < 1:
            raise CapacityError(f"{field} must be at least 1, got {value}")
    if gpu_memory_bytes < 1:
        raise CapacityError(f"gpu_memory_bytes must be positive, got {gpu_memory_bytes}")
    if not 0.0 < utilization <= 1.0:
        raise CapacityError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")


def check_engine_fits(
    shape: ModelShape,
    dtype: str,
    tp: int,
    gpu_memory_bytes: int,
    gpu_memory_utilization: float,
    max_model_len: int,
    block_size: int,
    *,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    used_bytes: int | None = None,
    quantization: str | None = None,
) -> FitVerdict:
    """The one verdict on loading ``shape`` over ``tp`` GPUs of ``gpu_memory_bytes`` each.

    The engine calls it before it allocates, with ``used_bytes`` it measured on its device
    (total − free once the weights are in), and allocates ``num_kv_blocks``; the operator's
    CapacityFits calls it (through :func:`plan_capacity`) with ``used_bytes`` None, predicted
    as the rank's weights + :data:`RANK_RUNTIME_OVERHEAD_BYTES`. Per rank:
    KV budget = int(memory × utilisation) − activation reserve − used; blocks = budget // (block_size
    × KV bytes/token/rank); fits when the heads split and blocks ≥ ceil(max_model_len / block_size).
    Raises :class:`CapacityError` only for inputs out of range (tp < 1, utilisation outside (0, 1]).
    """
    dtype = canonical_dtype(dtype)
    _check_inputs(tp, gpu_memory_bytes, gpu_memory_utilization, max_model_len, block_size)
    weights = per_rank_weights_bytes(shape, dtype, tp, quantization)
    used = weights + RANK_RUNTIME_OVERHEAD_BYTES if used_bytes is None else used_bytes
    reserve = activation_reserve_bytes(
        shape,
        dtype,
        tp,
        gpu_memory_bytes,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
    per_token = per_rank_kv_bytes_per_token(shape, dtype, tp)
    budget = kv_cache_budget_bytes(gpu_memory_bytes, used, gpu_memory_utilization, reserve)
    blocks, needed = kv_blocks(budget, block_size * per_token), blocks_for(max_model_len, block_size)
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    reason = tp_split_error(shape.num_heads, shape.num_kv_heads, tp)
    if reason is None and budget <= 0:
        reason = (
            f"per GPU, used {used} bytes (weights {weights}) + activation reserve {reserve} bytes "
            f"exceed the usable {usable} bytes"
        )
    elif reason is None and blocks < needed:
        reason = (
            f"per GPU, KV room for {blocks} blocks of {block_size} tokens is less than one sequence "
            f"of max_model_len {max_model_len} ({needed} blocks)"
        )
    return FitVerdict(
        fits=reason is None,
        reason=reason,
        tensor_parallel_size=tp,
        weights_bytes_per_rank=weights,
        used_bytes_per_rank=used,
        kv_heads_per_rank=kv_heads_per_rank(shape.num_kv_heads, tp),
        kv_bytes_per_token_per_rank=per_token,
        activation_reserve_bytes=reserve,
        usable_bytes_per_rank=usable,
        kv_cache_bytes_per_rank=max(0, budget),
        num_kv_blocks=blocks,
        kv_tokens=blocks * block_size,
        max_concurrent_sequences=blocks // needed,
    )


@dataclass(frozen=True)
class CapacityPlan:
    """A model on ``num_gpus`` (tensor-parallel size) × one GPU type. ``weights_bytes``,
    ``kv_bytes_per_token`` and ``num_params`` are the whole model's; ``usable_bytes``,
    ``activation_bytes`` (the reserve) and ``kv_bytes`` are per GPU; ``kv_tokens`` and
    ``max_concurrent_sequences`` are the replica's (every rank holds its heads of every token)."""

    model: str
    gpu: str
    num_gpus: int
    dtype: str
    context: int
    gpu_memory_utilization: float
    weights_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int
    usable_bytes: int
    kv_bytes: int
    kv_tokens: int
    max_concurrent_sequences: int
    decode_tokens_per_s_bound: float
    fits: bool
    reason: str | None
    decode_batch_size: int
    num_params: int
    weights_bytes_per_rank: int
    kv_bytes_per_token_per_rank: int
    kv_heads_per_rank: int
    kv_blocks: int
    block_size: int
    quantization: str = "none"  # the decoder linears' weight format (capacity_quant.WEIGHT_FORMATS)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _validate(context: int, batch_size: int | None, shape: ModelShape, **positive: int) -> None:
    if context > shape.max_position_embeddings:
        raise CapacityError(
            f"context {context} exceeds the max_position_embeddings {shape.max_position_embeddings} of {shape.name!r}"
        )
    for field, value in {
        **positive,
        "context": context,
        "batch_size": 1 if batch_size is None else batch_size,
    }.items():
        if value < 1:
            raise CapacityError(f"{field} must be at least 1, got {value}")


def plan_capacity(
    shape: ModelShape,
    gpu: GPUSpec,
    *,
    num_gpus: int = 1,
    context: int | None = None,
    dtype: str = "bfloat16",
    gpu_memory_utilization: float = 0.9,
    batch_size: int | None = None,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    block_size: int = 16,
    quantization: str | None = None,
) -> CapacityPlan:
    """What fits of ``shape`` on ``num_gpus`` × ``gpu`` (tensor parallel), and how fast decode can go.

    The verdict and the per-GPU figures are :func:`check_engine_fits`'s (the engine's own), at
    ``context`` tokens per sequence (default: the model's max_position_embeddings). The decode
    bound uses batch_size, by default max(1, max_concurrent_sequences); when nothing fits it is
    the bound as if it did.
    """
    dtype = canonical_dtype(dtype)
    ctx = shape.max_position_embeddings if context is None else context
    _validate(
        ctx,
        batch_size,
        shape,
        num_gpus=num_gpus,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
    v = check_engine_fits(
        shape,
        dtype,
        num_gpus,
        gpu.memory_bytes,
        gpu_memory_utilization,
        ctx,
        block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        quantization=quantization,
    )
    batch = batch_size if batch_size is not None else max(1, v.max_concurrent_sequences)
    bound = decode_tokens_per_s_bound(
        shape, gpu, num_gpus=num_gpus, context=ctx, batch_size=batch, dtype=dtype, quantization=quantization
    )
    return CapacityPlan(
        model=shape.name,
        gpu=gpu.name,
        num_gpus=num_gpus,
        dtype=dtype,
        context=ctx,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=per_rank_weights_bytes(shape, dtype, 1, quantization),
        kv_bytes_per_token=kv_bytes_per_token(shape, dtype),
        activation_bytes=v.activation_reserve_bytes,
        usable_bytes=v.usable_bytes_per_rank,
        kv_bytes=v.kv_cache_bytes_per_rank,
        kv_tokens=v.kv_tokens,
        max_concurrent_sequences=v.max_concurrent_sequences,
        decode_tokens_per_s_bound=bound,
        fits=v.fits,
        reason=v.reason,
        decode_batch_size=batch,
        num_params=shape.num_params,
        weights_bytes_per_rank=v.weights_bytes_per_rank,
        kv_bytes_per_token_per_rank=v.kv_bytes_per_token_per_rank,
        kv_heads_per_rank=v.kv_heads_per_rank,
        kv_blocks=v.num_kv_blocks,
        block_size=block_size,
        quantization=canonical_quantization(quantization),
    )
