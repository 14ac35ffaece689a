"""The engine's one verdict on whether a model loads on N GPUs (:func:`check_engine_fits`): the
engine calls it before it allocates its KV cache, the operator's CapacityFits and ``kvfleet plan``
through :func:`kvfleet.capacity.plan_capacity`; torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from .catalog import CapacityError, ModelShape, canonical_dtype
from .memory import (
    RANK_RUNTIME_OVERHEAD_BYTES,
    activation_reserve_bytes,
    blocks_for,
    kv_blocks,
    kv_cache_budget_bytes,
    per_rank_kv_bytes_per_sequence,
    per_rank_kv_bytes_per_token,
    per_rank_weights_bytes,
)
from .tp import kv_heads_per_rank, tp_split_error


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
    × KV bytes/token/rank); sequences = budget // one max_model_len sequence's KV (its sliding layers
    only their window's, :func:`~kvfleet.capacity.memory.per_rank_kv_bytes_per_sequence`); fits when
    the heads split and one sequence does.
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
    # A sliding layer holds only its window: a sequence's KV is full layers × context + sliding × window.
    seq_bytes = per_rank_kv_bytes_per_sequence(shape, dtype, tp, max_model_len, block_size)
    sequences = max(0, budget) // seq_bytes
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    reason = tp_split_error(shape.num_heads, shape.num_kv_heads, tp)
    if reason is None and budget <= 0:
        reason = (
            f"per GPU, used {used} bytes (weights {weights}) + activation reserve {reserve} bytes "
            f"exceed the usable {usable} bytes"
        )
    elif reason is None and sequences < 1:
        reason = (
            f"per GPU, KV room for {blocks} blocks of {block_size} tokens is less than one sequence "
            f"of max_model_len {max_model_len} ({needed} blocks)"
        )
        if shape.sliding_layers:
            reason += f", its {shape.sliding_layers} sliding layers counted at their window of {shape.sliding_window}"
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
        max_concurrent_sequences=sequences,
    )
