"""A model on N GPUs of one type, as ``kvfleet plan`` and the operator's status show it
(:func:`plan_capacity`): the engine's verdict and figures, and the decode bound; torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .catalog import CapacityError, GPUSpec, ModelShape, canonical_dtype
from .fits import check_engine_fits
from .memory import decode_tokens_per_s_bound, kv_bytes_per_token, per_rank_weights_bytes
from .quant import canonical_quantization

# The plan's figures that are the engine's verdict's (per GPU, or the replica's KV tokens and
# sequences): the plan's field, then the verdict's.
_FROM_VERDICT = {
    "fits": "fits",
    "reason": "reason",
    "activation_bytes": "activation_reserve_bytes",
    "usable_bytes": "usable_bytes_per_rank",
    "kv_bytes": "kv_cache_bytes_per_rank",
    "kv_blocks": "num_kv_blocks",
    "kv_tokens": "kv_tokens",
    "max_concurrent_sequences": "max_concurrent_sequences",
    "weights_bytes_per_rank": "weights_bytes_per_rank",
    "kv_bytes_per_token_per_rank": "kv_bytes_per_token_per_rank",
    "kv_heads_per_rank": "kv_heads_per_rank",
}


@dataclass(frozen=True)
class CapacityPlan:
    """A model on ``num_gpus`` (tensor-parallel size) × one GPU type. ``weights_bytes``,
    ``kv_bytes_per_token``, ``num_params`` and ``active_params`` are the whole model's; ``usable_bytes``,
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
    quantization: str = "none"  # the decoder linears' weight format (quant.WEIGHT_FORMATS)
    active_params: int = 0  # parameters one token runs through (a mixture of experts: top-k experts)

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
        num_params=shape.num_params,
        active_params=shape.active_params,
        weights_bytes=per_rank_weights_bytes(shape, dtype, 1, quantization),
        kv_bytes_per_token=kv_bytes_per_token(shape, dtype),
        dtype=dtype,
        quantization=canonical_quantization(quantization),
        context=ctx,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        decode_tokens_per_s_bound=bound,
        decode_batch_size=batch,
        **{field: getattr(v, figure) for field, figure in _FROM_VERDICT.items()},
    )
