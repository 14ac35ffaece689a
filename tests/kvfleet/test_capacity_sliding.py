"""Capacity maths with sliding-window layers (Gemma 3's hybrid KV cache, engine/kv/groups.py): a
sequence's KV is full layers x context + sliding layers x window, with Gemma 3's real shapes."""

from kvfleet.capacity import (
    KNOWN_MODELS,
    check_engine_fits,
    model_shape_from_config,
    per_rank_kv_bytes_per_sequence,
    plan_capacity,
    resolve_gpu,
)

# google/gemma-3-27b-it's text_config: 62 layers, each 6th global, the others a 1024-token window.
GEMMA3_27B = {
    "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
    "sliding_window_pattern": 6, "vocab_size": 262208, "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}  # fmt: skip


def test_gemma3_27b_counts_52_sliding_layers_of_1024_tokens_and_10_global_ones() -> None:
    shape = model_shape_from_config(GEMMA3_27B, "gemma-3-27b")
    assert (shape.sliding_layers, shape.sliding_window) == (52, 1024)
    layer_token = 2 * 16 * 128 * 2  # K and V of one token in one layer, bf16
    # 10 global layers hold 131072 tokens; 52 sliding ones 65 blocks of 16 (the window's 64 + the one it starts in)
    seq = per_rank_kv_bytes_per_sequence(shape, "bfloat16", 1, 131072, 16)
    assert seq == layer_token * (10 * 131072 + 52 * 1040) == 11_180_441_600
    assert 62 * 131072 * layer_token // seq == 5  # about 6x less than every layer's whole context


def test_layer_types_name_the_sliding_layers_and_qwen_without_use_sliding_window_has_none() -> None:
    types = ["sliding_attention"] * 5 + ["full_attention"]
    gemma = model_shape_from_config({**GEMMA3_27B, "num_hidden_layers": 6, "layer_types": types})
    assert gemma.sliding_layers == 5
    qwen = {**GEMMA3_27B, "model_type": "qwen2", "use_sliding_window": False}
    assert model_shape_from_config(qwen).sliding_layers == 0


def test_a_full_context_gemma3_27b_fits_on_one_h200_only_because_the_sliding_layers_hold_their_window() -> (
    None
):
    shape = model_shape_from_config(GEMMA3_27B, "gemma-3-27b")
    plan = plan_capacity(shape, resolve_gpu("h200"), context=131072)
    seq = per_rank_kv_bytes_per_sequence(shape, "bfloat16", 1, 131072, 16)
    assert plan.fits and plan.max_concurrent_sequences == plan.kv_bytes // seq >= 5
    every_layer = 62 * 131072 * 2 * 16 * 128 * 2
    assert plan.kv_bytes // every_layer == 1  # counted on every layer, one sequence


def test_gemma3_1b_known_shape_counts_its_window_and_the_verdict_says_so_when_nothing_fits() -> None:
    shape = KNOWN_MODELS["gemma-3-1b"]
    assert per_rank_kv_bytes_per_sequence(shape, "bfloat16", 1, 32768, 16) == 1024 * (4 * 32768 + 22 * 528)
    tight = check_engine_fits(shape, "bfloat16", 1, 4 * 2**30, 0.9, 32768, 16)
    assert tight.max_concurrent_sequences == tight.kv_cache_bytes_per_rank // 146_112_512
    none = check_engine_fits(shape, "bfloat16", 1, 4 * 2**30, 0.9, 32768 * 64, 16)
    assert not none.fits and "22 sliding layers counted at their window of 512" in (none.reason or "")


def test_a_sliding_layer_reads_only_its_window_in_the_decode_bound() -> None:
    shape = model_shape_from_config(GEMMA3_27B, "gemma-3-27b")
    gpu = resolve_gpu("h200")
    windowed = plan_capacity(shape, gpu, context=131072, batch_size=4).decode_tokens_per_s_bound
    full = plan_capacity(
        model_shape_from_config({**GEMMA3_27B, "sliding_window": None}), gpu, context=131072, batch_size=4
    ).decode_tokens_per_s_bound
    assert windowed > 2 * full
