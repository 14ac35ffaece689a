"""Tensor-parallel capacity maths (issue #29): how a model splits over ranks, and what one rank needs."""

from __future__ import annotations

import pytest

from kvfleet.capacity import (
    GIB,
    GPUS,
    KNOWN_MODELS,
    RANK_RUNTIME_OVERHEAD_BYTES,
    CapacityError,
    check_engine_fits,
    kv_heads_per_rank,
    model_shape_from_config,
    per_rank_kv_bytes_per_token,
    per_rank_params,
    per_rank_weights_bytes,
    plan_capacity,
    q_heads_per_rank,
    tp_split_error,
    weights_bytes,
)

LLAMA_70B = KNOWN_MODELS["llama-3-70b"]
H100 = GPUS["h100"]


def test_any_tp_up_to_the_kv_heads_splits_and_past_them_only_multiples_dividing_the_query_heads() -> None:
    assert [tp_split_error(64, 8, tp) for tp in (1, 2, 3, 5, 7, 8)] == [None] * 6
    assert tp_split_error(64, 8, 16) is None  # each KV head on 2 ranks, 4 query heads per rank
    assert tp_split_error(28, 4, 8) == "tensor-parallel size 8 does not divide the 28 query heads"
    assert tp_split_error(32, 4, 6) == (
        "tensor-parallel size 6 exceeds the 4 KV heads and is not a multiple of them "
        "(a KV head is replicated over tp / kv_heads ranks)"
    )
    assert tp_split_error(32, 8, 0) == "tensor-parallel size must be at least 1, got 0"


def test_kv_heads_per_rank_is_the_biggest_ranks_share_and_never_below_one_head() -> None:
    assert [kv_heads_per_rank(8, tp) for tp in (1, 2, 3, 4, 8, 16)] == [8, 4, 3, 2, 1, 1]
    assert kv_heads_per_rank(3, 2) == 2  # 3 KV heads over 2 ranks: 2 + 1
    # query heads follow their KV heads' whole GQA groups; past the KV heads they split evenly
    assert (q_heads_per_rank(12, 3, 2), q_heads_per_rank(64, 8, 16), q_heads_per_rank(32, 4, 8)) == (8, 4, 4)


def test_one_rank_holds_the_whole_model_and_even_splits_hold_a_share_plus_the_replicated_norms() -> None:
    for shape in KNOWN_MODELS.values():
        assert per_rank_params(shape, 1) == shape.num_params
    norms = LLAMA_70B.num_layers * 2 * LLAMA_70B.hidden_size + LLAMA_70B.hidden_size  # 1_318_912
    for tp in (2, 4, 8):
        assert per_rank_params(LLAMA_70B, tp) == (LLAMA_70B.num_params - norms) // tp + norms


def test_replicated_kv_heads_keep_one_whole_head_per_rank_in_the_weights_and_the_kv_cache() -> None:
    """2 KV heads over 4 ranks: every rank holds one KV head (each replicated twice), so the
    k/v projections and the KV cache per rank are half the model's, not a quarter."""
    shape = model_shape_from_config(
        {
            "hidden_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "intermediate_size": 4096,
            "vocab_size": 32000,
        },
        name="gqa2",
    )
    d, h = 64, 1024
    attention = 2 * h * 4 * d + 2 * h * 1 * d  # 4 query heads (q, o), 1 KV head (k, v)
    per_layer = attention + 3 * h * 1024 + 2 * h
    assert per_rank_params(shape, 4) == 4 * per_layer + 2 * 8000 * h + h
    assert per_rank_kv_bytes_per_token(shape, "bfloat16", 4) == 2 * 4 * 1 * 64 * 2 == 1024
    assert per_rank_kv_bytes_per_token(shape, "bfloat16", 2) == 1024  # 2 heads over 2: one each


def test_seventy_b_on_one_h100_does_not_fit_its_141_gb_of_weights_in_72_gib() -> None:
    """70.55 B params × 2 bytes = 141.1 GB on one 80 GiB GPU: the weights alone exceed it."""
    v = check_engine_fits(LLAMA_70B, "bf16", 1, H100.memory_bytes, 0.9, 8192, 16)
    assert (v.fits, v.weights_bytes_per_rank, v.num_kv_blocks) == (False, 141_107_412_992, 0)
    assert v.reason == (
        "per GPU, used 142181154816 bytes (weights 141107412992) + activation reserve 4294967296 bytes "
        "exceed the usable 77309411328 bytes"
    )


def test_seventy_b_on_two_h100_fits_one_full_context_sequence_and_little_more() -> None:
    """Half the weights, 70.56 GB (65.7 GiB), + 1 GiB CUDA/NCCL + the 4 GiB reserve leave 1.29 GiB of
    the 72 GiB usable: 528 blocks of 16 tokens at 163,840 bytes per token (4 of the 8 KV heads),
    one sequence of 8192 tokens (512 blocks). It loads, but serves one full-context request."""
    v = check_engine_fits(LLAMA_70B, "bf16", 2, H100.memory_bytes, 0.9, 8192, 16)
    assert (v.weights_bytes_per_rank, v.kv_heads_per_rank, v.kv_bytes_per_token_per_rank) == (
        70_555_025_408,
        4,
        163_840,
    )
    assert v.kv_cache_bytes_per_rank == 77_309_411_328 - 4 * GIB - 70_555_025_408 - GIB == 1_385_676_800
    assert (v.num_kv_blocks, v.kv_tokens, v.max_concurrent_sequences, v.fits) == (528, 8448, 1, True)
    # with more activation room (a 0.88 share) it no longer holds one sequence
    assert not check_engine_fits(LLAMA_70B, "bf16", 2, H100.memory_bytes, 0.88, 8192, 16).fits


def test_seventy_b_on_four_h100_holds_35_gb_of_weights_and_54_full_sequences_per_replica() -> None:
    """A quarter of the weights, 35.28 GB, and 2 KV heads per rank (81,920 bytes a token): 34.1 GiB
    of KV per GPU, 27,970 blocks, 54 sequences of 8192 tokens."""
    v = check_engine_fits(LLAMA_70B, "bf16", 4, H100.memory_bytes, 0.9, 8192, 16)
    assert (v.weights_bytes_per_rank, v.kv_heads_per_rank, v.kv_bytes_per_token_per_rank) == (
        35_278_831_616,
        2,
        81_920,
    )
    assert v.kv_cache_bytes_per_rank == 36_661_870_592
    assert (v.num_kv_blocks, v.max_concurrent_sequences, v.fits) == (27_970, 54, True)


def test_seventy_b_on_eight_h100_holds_17_6_gb_of_weights_and_one_kv_head_per_gpu() -> None:
    """An eighth of the weights, 17.64 GB, one KV head a rank (40,960 bytes a token): 161 sequences."""
    v = check_engine_fits(LLAMA_70B, "bf16", 8, H100.memory_bytes, 0.9, 8192, 16)
    assert (v.weights_bytes_per_rank, v.kv_heads_per_rank, v.kv_bytes_per_token_per_rank) == (
        17_640_734_720,
        1,
        40_960,
    )
    assert (v.num_kv_blocks, v.max_concurrent_sequences, v.fits) == (82_855, 161, True)


def test_the_plan_reads_its_verdict_and_per_gpu_figures_from_the_engines_check() -> None:
    for tp in (1, 2, 4, 8):
        plan = plan_capacity(LLAMA_70B, H100, num_gpus=tp)
        v = check_engine_fits(LLAMA_70B, "bfloat16", tp, H100.memory_bytes, 0.9, 8192, 16)
        assert (plan.fits, plan.reason, plan.kv_blocks, plan.kv_bytes) == (
            v.fits,
            v.reason,
            v.num_kv_blocks,
            v.kv_cache_bytes_per_rank,
        )
        assert plan.weights_bytes == weights_bytes(LLAMA_70B) and plan.weights_bytes_per_rank == (
            per_rank_weights_bytes(LLAMA_70B, "bfloat16", tp)
        )


def test_memory_the_engine_measured_replaces_the_predicted_weights_and_overhead() -> None:
    predicted = check_engine_fits(LLAMA_70B, "bf16", 4, H100.memory_bytes, 0.9, 8192, 16)
    assert predicted.used_bytes_per_rank == 35_278_831_616 + RANK_RUNTIME_OVERHEAD_BYTES
    measured = check_engine_fits(
        LLAMA_70B, "bf16", 4, H100.memory_bytes, 0.9, 8192, 16, used_bytes=predicted.used_bytes_per_rank + GIB
    )
    assert measured.kv_cache_bytes_per_rank == predicted.kv_cache_bytes_per_rank - GIB


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 0.9, 8192, 16), "tensor-parallel size must be at least 1, got 0"),
        ((2, 1.2, 8192, 16), r"gpu_memory_utilization must be in \(0, 1\], got 1.2"),
        ((2, 0.9, 0, 16), "max_model_len must be at least 1, got 0"),
        ((2, 0.9, 8192, 0), "block_size must be at least 1, got 0"),
    ],
)
def test_inputs_out_of_range_raise_naming_the_value_instead_of_a_verdict(
    args: tuple[int, float, int, int], message: str
) -> None:
    tp, utilization, max_model_len, block_size = args
    with pytest.raises(CapacityError, match=message):
        check_engine_fits(LLAMA_70B, "bf16", tp, H100.memory_bytes, utilization, max_model_len, block_size)
