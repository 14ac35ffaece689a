"""Bytes per weight of each served weight format (``--quantization``), for the capacity maths; torch-free.

Where it sits: :mod:`kvfleet.capacity` sizes a rank's weights through :func:`per_rank_weight_bytes`
for ``kvfleet plan --quantization``, the operator's CapacityFits (``spec.engine.quantization``) and
the engine's own verdict. As vLLM (and this engine on a GPU) serve FP8/int8 W8A8, the quantised
weights are the decoder layers' linears (q, k, v, o, gate, up, down); the embedding, the LM head
and the norms stay in the model dtype (for a .gguf, whose embedding is often Q8_0/Q6_K too, that
overestimates a little: the safe side). Per format, bytes per weight:

- ``int8``, ``fp8``: 1, plus one float32 scale (4 bytes) per output row of each linear;
- GGUF blocks (scales inside the block): Q8_0 34/32 = 1.0625, Q4_0 18/32 = 0.5625,
  Q4_1 20/32 = 0.625 (5 bits a weight), Q4_K 144/256 = 0.5625, Q5_K 176/256 = 0.6875,
  Q6_K 210/256 = 0.8203125.
"""

from __future__ import annotations

import math
from fractions import Fraction

from .catalog import DTYPE_BYTES, CapacityError, ModelShape, canonical_dtype
from .tp import kv_heads_per_rank, per_rank_params, q_heads_per_rank

WEIGHT_FORMATS: dict[str, Fraction | None] = {
    "none": None,  # the model dtype
    "int8": Fraction(1),
    "fp8": Fraction(1),
    "gguf-q8_0": Fraction(34, 32),
    "gguf-q4_0": Fraction(18, 32),
    "gguf-q4_1": Fraction(20, 32),
    "gguf-q4_k": Fraction(144, 256),
    "gguf-q5_k": Fraction(176, 256),
    "gguf-q6_k": Fraction(210, 256),
}
PER_CHANNEL_SCALED = frozenset({"int8", "fp8"})
SCALE_BYTES = 4


class UnknownQuantizationError(CapacityError):
    pass


def canonical_quantization(name: str | None) -> str:
    """The WEIGHT_FORMATS key for ``name`` (None → ``none``; case-insensitive)."""
    key = "none" if name is None else name.strip().lower()
    if key not in WEIGHT_FORMATS:
        raise UnknownQuantizationError(
            f"unknown quantization {name!r}: known formats are {', '.join(WEIGHT_FORMATS)}"
        )
    return key


def per_rank_linears(shape: ModelShape, tp: int) -> tuple[int, int]:
    """(weights, output rows) of every decoder layer's linears on the biggest of ``tp`` ranks (every
    expert's included; a router stays in the model dtype)."""
    h, d = shape.hidden_size, shape.head_dim
    q_width = q_heads_per_rank(shape.num_heads, shape.num_kv_heads, tp) * d
    kv_width = kv_heads_per_rank(shape.num_kv_heads, tp) * d
    inter, expert = math.ceil(shape.intermediate_size / tp), math.ceil(shape.expert_intermediate_size / tp)
    attention = 2 * h * q_width + 2 * h * kv_width
    attention_rows = q_width + 2 * kv_width + h  # o: row-parallel, all h output rows
    dense, sparse = shape.num_layers - shape.sparse_layers, shape.sparse_layers
    weights = (
        shape.num_layers * attention + dense * 3 * h * inter + sparse * shape.num_experts * 3 * h * expert
    )
    rows = shape.num_layers * attention_rows + (
        dense * (2 * inter + h) + sparse * shape.num_experts * (2 * expert + h)
    )
    return weights, rows


def per_rank_weight_bytes(shape: ModelShape, dtype: str, tp: int, quantization: str | None = None) -> int:
    """The weights of the biggest of ``tp`` ranks: the linears in ``quantization``'s bytes, the rest in ``dtype``."""
    per_weight = WEIGHT_FORMATS[canonical_quantization(quantization)]
    dtype_bytes = DTYPE_BYTES[canonical_dtype(dtype)]
    total = per_rank_params(shape, tp)
    if per_weight is None:
        return total * dtype_bytes
    linears, rows = per_rank_linears(shape, tp)
    scales = SCALE_BYTES * rows if canonical_quantization(quantization) in PER_CHANNEL_SCALED else 0
    return (total - linears) * dtype_bytes + math.ceil(linears * per_weight) + scales


def per_rank_expert_bytes(shape: ModelShape, dtype: str, tp: int, quantization: str | None = None) -> int:
    """The bytes of every expert's linears on the biggest of ``tp`` ranks, in ``quantization``'s
    bytes per weight (0 for a dense model): what a decode step reads only of the experts it hits."""
    per_weight = WEIGHT_FORMATS[canonical_quantization(quantization)]
    weights = shape.sparse_layers * shape.num_experts * 3 * shape.hidden_size
    weights *= math.ceil(shape.expert_intermediate_size / tp) if shape.num_experts else 0
    if per_weight is None:
        return weights * DTYPE_BYTES[canonical_dtype(dtype)]
    return math.ceil(weights * per_weight)
