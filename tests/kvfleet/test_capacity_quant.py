"""Bytes per weight by format in the capacity maths (kvfleet/capacity/quant.py), with exact figures.

Llama-3-70B (80 layers, hidden 8192, 64/8 heads of 128, intermediate 28672, vocab 128256, untied):
its decoder linears hold 80 × (2·8192·8192 + 2·8192·1024 + 3·8192·28672) = 68 451 041 280 weights
with 80 × (8192 + 2·1024 + 8192 + 2·28672 + 8192) = 6 717 440 output rows; the other
70 553 706 496 − 68 451 041 280 = 2 102 665 216 parameters (embeddings, LM head, norms) stay bf16."""

from __future__ import annotations

import pytest

from kvfleet.capacity import per_rank_weights_bytes, plan_capacity, resolve_gpu, resolve_model
from kvfleet.capacity.quant import UnknownQuantizationError, canonical_quantization, per_rank_linears

LLAMA_70B = resolve_model("llama-3-70b")
REST_BF16 = 2 * 2_102_665_216


def test_the_70b_decoder_linears_and_their_rows_are_counted_exactly() -> None:
    assert per_rank_linears(LLAMA_70B, 1) == (68_451_041_280, 6_717_440)


def test_fp8_and_int8_take_one_byte_a_weight_plus_a_float_scale_a_row() -> None:
    want = REST_BF16 + 68_451_041_280 + 4 * 6_717_440
    assert want == 72_683_241_472
    assert per_rank_weights_bytes(LLAMA_70B, "bfloat16", 1, "fp8") == want
    assert per_rank_weights_bytes(LLAMA_70B, "bfloat16", 1, "int8") == want


def test_gguf_formats_take_their_block_bytes_a_weight() -> None:
    assert (
        per_rank_weights_bytes(LLAMA_70B, "bfloat16", 1, "gguf-q4_1") == REST_BF16 + 68_451_041_280 * 5 // 8
    )
    assert (
        per_rank_weights_bytes(LLAMA_70B, "bfloat16", 1, "gguf-q8_0") == REST_BF16 + 68_451_041_280 * 17 // 16
    )
    assert per_rank_weights_bytes(LLAMA_70B, "bfloat16", 1, "none") == 2 * LLAMA_70B.num_params


def test_llama_3_70b_in_fp8_does_not_fit_one_h100_and_fits_two() -> None:
    h100 = resolve_gpu("h100")
    one = plan_capacity(LLAMA_70B, h100, num_gpus=1, quantization="fp8")
    assert (one.fits, one.weights_bytes_per_rank, one.quantization) == (False, 72_683_241_472, "fp8")
    # per rank: half the linears, 80 × 50 176 rows' scales, half the vocabulary rows, every norm
    per_rank = 68_451_041_280 // 2 + 4 * 80 * 50_176 + 2 * (2 * 64_128 * 8192 + 2 * 8192 * 80 + 8192)
    two = plan_capacity(LLAMA_70B, h100, num_gpus=2, quantization="fp8")
    assert (two.fits, two.weights_bytes_per_rank, two.kv_tokens) == (True, per_rank, 217_248)
    assert per_rank == 36_345_561_088


def test_an_unknown_format_is_refused_naming_the_known_ones() -> None:
    assert canonical_quantization(None) == "none"
    with pytest.raises(UnknownQuantizationError, match="gguf-q4_1"):
        canonical_quantization("awq")
