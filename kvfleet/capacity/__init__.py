"""Capacity maths (docs/architecture.md §4): what fits on which GPUs, per tensor-parallel rank, torch-free.

Shared by ``kvfleet plan`` (the table a user reads before buying GPUs), the engine's
simulated mode (decode cost per step), the operator (the capacity figures and the
``CapacityFits`` condition of an InferenceService's status) and the engine itself, which
calls :func:`check_engine_fits` before it allocates its KV cache: one verdict, so the
operator never says "fits" for a model the engine refuses to load. It never loads weights.

Tensor parallelism (``--tensor-parallel-size N``, one engine pod with N GPUs) splits a model
the way the engine shards it: the column-parallel linears (q, k, v, gate, up) and the
row-parallel ones (o, down) by output or input features, the embedding and lm_head by
vocabulary rows, the RMSNorms replicated; attention by whole GQA groups, so each rank holds
ceil(kv_heads / N) KV heads (a KV head is replicated when N > kv_heads). Every figure is of
the biggest rank, which is the one that runs out of memory first.

This package's public API is what it imports here; callers import from ``kvfleet.capacity``.
Its modules, each on the ones before it:

- :mod:`~kvfleet.capacity.catalog`: GPUs' datasheet figures, model shapes (known names or a
  ``config.json``), dtypes, and the errors naming a bad value;
- :mod:`~kvfleet.capacity.tp`: how heads, features and vocabulary split over the ranks;
- :mod:`~kvfleet.capacity.quant`: bytes per weight of each served format (``--quantization``);
- :mod:`~kvfleet.capacity.memory`: a rank's bytes (weights, KV per token, activation reserve,
  KV budget and blocks) and the bandwidth bound on decode;
- :mod:`~kvfleet.capacity.fits`: the engine's verdict, :func:`check_engine_fits`;
- :mod:`~kvfleet.capacity.plan`: a model on N GPUs of one type as ``kvfleet plan`` shows it.
"""

from __future__ import annotations

from .catalog import (
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
from .fits import FitVerdict, check_engine_fits
from .memory import (
    ENGINE_ACTIVATION_RESERVE,
    RANK_RUNTIME_OVERHEAD_BYTES,
    activation_bytes,
    activation_reserve_bytes,
    blocks_for,
    decode_tokens_per_s_bound,
    kv_blocks,
    kv_bytes_per_token,
    kv_cache_budget_bytes,
    per_rank_kv_bytes_per_sequence,
    per_rank_kv_bytes_per_token,
    per_rank_weights_bytes,
    weights_bytes,
)
from .plan import CapacityPlan, plan_capacity
from .quant import WEIGHT_FORMATS, UnknownQuantizationError, canonical_quantization, per_rank_weight_bytes
from .tp import kv_heads_per_rank, per_rank_params, q_heads_per_rank, tp_split_error

__all__ = [
    "DTYPE_BYTES",
    "ENGINE_ACTIVATION_RESERVE",
    "GIB",
    "GPUS",
    "KNOWN_MODELS",
    "RANK_RUNTIME_OVERHEAD_BYTES",
    "WEIGHT_FORMATS",
    "CapacityError",
    "CapacityPlan",
    "FitVerdict",
    "GPUSpec",
    "ModelShape",
    "UnknownDtypeError",
    "UnknownGPUError",
    "UnknownModelError",
    "UnknownQuantizationError",
    "activation_bytes",
    "activation_reserve_bytes",
    "blocks_for",
    "canonical_dtype",
    "canonical_quantization",
    "check_engine_fits",
    "decode_tokens_per_s_bound",
    "kv_blocks",
    "kv_bytes_per_token",
    "kv_cache_budget_bytes",
    "kv_heads_per_rank",
    "model_shape_from_config",
    "per_rank_kv_bytes_per_sequence",
    "per_rank_kv_bytes_per_token",
    "per_rank_params",
    "per_rank_weight_bytes",
    "per_rank_weights_bytes",
    "plan_capacity",
    "q_heads_per_rank",
    "resolve_gpu",
    "resolve_model",
    "tp_split_error",
    "weights_bytes",
]
