"""The capacity maths of kvfleet/capacity/, against hand-computed figures and published parameter counts."""

import json
from pathlib import Path

import pytest

from kvfleet.capacity import (
    DTYPE_BYTES,
    GIB,
    GPUS,
    KNOWN_MODELS,
    CapacityError,
    UnknownDtypeError,
    UnknownGPUError,
    UnknownModelError,
    activation_bytes,
    kv_bytes_per_token,
    model_shape_from_config,
    plan_capacity,
    resolve_gpu,
    resolve_model,
    weights_bytes,
)

LLAMA_3_8B = KNOWN_MODELS["llama-3-8b"]


def test_llama_3_8b_kv_bytes_per_token_is_two_times_layers_kv_heads_head_dim_and_dtype_bytes() -> None:
    assert kv_bytes_per_token(LLAMA_3_8B, "bfloat16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(LLAMA_3_8B, "float32") == 262144
    assert kv_bytes_per_token(LLAMA_3_8B, "fp8") == 65536
    assert kv_bytes_per_token(LLAMA_3_8B, "BF16") == 131072


def test_known_models_have_the_parameter_counts_their_publishers_state() -> None:
    # Published counts (Hugging Face model cards / safetensors metadata).
    assert LLAMA_3_8B.num_params == 8_030_261_248
    assert KNOWN_MODELS["llama-3-70b"].num_params == 70_553_706_496
    assert KNOWN_MODELS["llama-3.2-1b"].num_params == 1_235_814_400
    assert KNOWN_MODELS["qwen2-7b"].num_params == 7_615_616_512
    assert KNOWN_MODELS["mistral-7b"].num_params == 7_241_732_096
    assert KNOWN_MODELS["gemma-3-1b"].num_params == 999_885_952
    assert weights_bytes(LLAMA_3_8B, "bfloat16") == 16_060_522_496
    assert weights_bytes(LLAMA_3_8B, "int8") == 8_030_261_248


def test_an_explicit_head_dim_and_tied_embeddings_are_counted_as_written() -> None:
    config = {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "intermediate_size": 160,
        "vocab_size": 300,
        "tie_word_embeddings": True,
    }
    # per layer: q 64·96 + k, v 2·64·48 + o 96·64 + SwiGLU 3·64·160 + 2 norms 64 = 49280
    assert model_shape_from_config(config).num_params == 3 * 49280 + 300 * 64 + 64 == 167_104


def test_qwen3_and_gemma3_configs_count_their_q_k_norms_and_gemmas_extra_norms() -> None:
    config = {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 24, "intermediate_size": 160, "vocab_size": 300, "tie_word_embeddings": True,
    }  # fmt: skip
    # as above (49280 per layer) + q/k norms 2·24; Gemma 3: + 2 more norms of 64
    assert model_shape_from_config({**config, "model_type": "qwen3"}).num_params == 3 * 49328 + 300 * 64 + 64
    gemma = model_shape_from_config({**config, "model_type": "gemma3_text"})
    assert gemma.num_params == 3 * (49328 + 128) + 300 * 64 + 64
    assert kv_bytes_per_token(gemma, "bfloat16") == 2 * 3 * 2 * 24 * 2  # every layer's, the global ones' too


def test_head_dim_defaults_to_hidden_size_over_heads() -> None:
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    shape = model_shape_from_config({**config, "vocab_size": 100}, name="t")
    assert (shape.head_dim, shape.num_kv_heads, shape.tie_word_embeddings) == (16, 4, False)


def test_one_h100_holds_llama_3_8b_with_room_for_52_full_context_sequences() -> None:
    plan = plan_capacity(LLAMA_3_8B, resolve_gpu("h100"), context=8192)
    usable = 80 * GIB * 9 // 10  # 77_309_411_328
    # the activation estimate, 8192 tokens × (2·4096 + (32 + 2·8)·128 + 2·14336) × 2 bytes + 256 rows ×
    # 128256 × 4, is below the engine's 5 % of the GPU, which is the reserve then
    assert activation_bytes(LLAMA_3_8B) == 8192 * 43008 * 2 + 256 * 128256 * 4 == 835_977_216
    assert (plan.usable_bytes, plan.activation_bytes) == (usable, 80 * GIB // 20) == (77_309_411_328, 4 * GIB)
    # KV = usable − reserve − (weights + the 1 GiB CUDA context and workspaces)
    assert plan.kv_bytes == usable - 4 * GIB - (16_060_522_496 + GIB) == 55_880_179_712
    assert plan.kv_blocks == 55_880_179_712 // (16 * 131072) == 26_645
    assert plan.kv_tokens == 26_645 * 16 == 426_320
    assert plan.max_concurrent_sequences == 26_645 // 512 == 52
    assert plan.decode_batch_size == 52
    assert plan.decode_tokens_per_s_bound == 52 * 3.35e12 / (16_060_522_496 + 52 * 8192 * 131072)
    assert (plan.fits, plan.reason) == (True, None)


def test_the_decode_bound_at_batch_one_reads_the_weights_and_one_sequence_per_token() -> None:
    plan = plan_capacity(LLAMA_3_8B, GPUS["h200"], context=1024, batch_size=1)
    assert plan.decode_batch_size == 1
    assert plan.decode_tokens_per_s_bound == 4.8e12 / (16_060_522_496 + 1024 * 131072)


def test_seventy_b_does_not_fit_on_one_l4_and_the_reason_names_weights_and_usable_bytes() -> None:
    plan = plan_capacity(KNOWN_MODELS["llama-3-70b"], resolve_gpu("L4"), context=4096)
    assert plan.weights_bytes == plan.weights_bytes_per_rank == 141_107_412_992
    assert plan.usable_bytes == 23_192_823_398
    assert (plan.fits, plan.kv_bytes, plan.kv_tokens, plan.max_concurrent_sequences) == (False, 0, 0, 0)
    assert plan.reason is not None
    assert "141107412992" in plan.reason and "23192823398" in plan.reason


def test_seventy_b_fits_on_four_h100_with_a_quarter_of_the_weights_and_kv_heads_on_each() -> None:
    """Each H100 holds 35.28 GB of weights (the 8 KV heads split 2 per rank) and a 5 % reserve."""
    shape = KNOWN_MODELS["llama-3-70b"]
    plan = plan_capacity(shape, GPUS["h100"], num_gpus=4)
    assert (plan.weights_bytes_per_rank, plan.kv_heads_per_rank) == (35_278_831_616, 2)
    assert plan.kv_bytes_per_token_per_rank == 2 * 80 * 2 * 128 * 2 == 81_920
    assert plan.kv_bytes == 80 * GIB * 9 // 10 - 4 * GIB - (35_278_831_616 + GIB) == 36_661_870_592
    assert (plan.kv_tokens, plan.max_concurrent_sequences, plan.context) == (27_970 * 16, 54, 8192)
    assert plan.decode_tokens_per_s_bound == 54 * 3.35e12 / (35_278_831_616 + 54 * 8192 * 81_920)


def test_kv_room_shorter_than_one_context_does_not_fit_and_says_so() -> None:
    plan = plan_capacity(LLAMA_3_8B, GPUS["l4"], gpu_memory_utilization=0.73)
    # 24 GiB × 0.73 − the 5 % reserve − (weights + 1 GiB)
    assert plan.kv_bytes == 18_811_956_756 - 1_288_490_188 - (16_060_522_496 + GIB) == 389_202_248
    assert (plan.kv_blocks, plan.max_concurrent_sequences, plan.fits) == (185, 0, False)
    assert plan.reason == (
        "per GPU, KV room for 185 blocks of 16 tokens is less than one sequence of max_model_len 8192 (512 blocks)"
    )


def test_the_plan_serialises_every_figure_to_json() -> None:
    d = json.loads(json.dumps(plan_capacity(LLAMA_3_8B, GPUS["a100"], context=2048).to_dict()))
    assert (d["kv_bytes_per_token"], d["weights_bytes"], d["context"], d["gpu"]) == (
        131072,
        16_060_522_496,
        2048,
        "A100 SXM 80GB",
    )


def test_gpu_names_are_case_insensitive_and_the_h200_is_141_gb_at_4_8_tb_s() -> None:
    assert resolve_gpu("H200") == GPUS["h200"]
    assert (GPUS["h200"].memory_bytes, GPUS["h200"].bandwidth_bytes_per_s) == (141 * GIB, 4.8e12)
    assert resolve_gpu("A100-80GB") is GPUS["a100"]


def test_an_unknown_gpu_is_a_value_error_naming_it_and_the_known_ones() -> None:
    with pytest.raises(
        UnknownGPUError, match=r"unknown GPU 'b200': known GPUs are h100, h200, a100, a100-40gb"
    ):
        resolve_gpu("b200")
    assert issubclass(UnknownGPUError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_gpus": 0}, "num_gpus must be at least 1, got 0"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        ({"context": 0}, "context must be at least 1, got 0"),
        ({"context": 8193}, "context 8193 exceeds the max_position_embeddings 8192 of 'llama-3-8b'"),
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
    ],
)
def test_out_of_range_plan_inputs_raise_naming_the_value(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(CapacityError, match=message):
        plan_capacity(LLAMA_3_8B, GPUS["h100"], **kwargs)


def test_an_unknown_dtype_names_it_and_the_known_ones() -> None:
    with pytest.raises(UnknownDtypeError, match="unknown dtype 'int4': known dtypes are float32, float16"):
        plan_capacity(LLAMA_3_8B, GPUS["h100"], dtype="int4")
    assert DTYPE_BYTES == {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


def test_known_model_names_resolve_case_insensitively_and_by_hub_id() -> None:
    assert resolve_model("Llama-3-8B") is LLAMA_3_8B
    assert resolve_model("meta-llama/Meta-Llama-3-8B") is LLAMA_3_8B
    assert resolve_model("Qwen/Qwen2-7B") is KNOWN_MODELS["qwen2-7b"]


def test_an_unknown_model_names_it_and_the_known_ones() -> None:
    with pytest.raises(UnknownModelError, match="unknown model 'gpt-5'.*llama-3-8b, llama-3-70b"):
        resolve_model("gpt-5")


def _write_config(folder: Path, **overrides: object) -> Path:
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        **overrides,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_folder_holding_config_json_resolves_to_its_shape_named_after_the_folder(tmp_path: Path) -> None:
    folder = _write_config(tmp_path / "tiny-llama")
    shape = resolve_model(str(folder))
    assert shape == resolve_model(str(folder / "config.json"))
    assert (shape.name, shape.head_dim, shape.num_kv_heads, shape.max_position_embeddings) == (
        "tiny-llama",
        32,
        2,
        2048,
    )
    assert kv_bytes_per_token(shape) == 2 * 4 * 2 * 32 * 2 == 1024


def test_a_folder_without_config_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="holds no config.json"):
        resolve_model(str(tmp_path))


def test_a_corrupt_config_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnknownModelError, match=r"cannot read model config .*config.json"):
        resolve_model(str(tmp_path))


def test_an_unsupported_architecture_or_a_missing_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="model_type 'gpt_neox' is not supported"):
        resolve_model(str(_write_config(tmp_path / "neox", model_type="gpt_neox")))
    with pytest.raises(UnknownModelError, match="'vocab_size' must be a positive integer, got None"):
        model_shape_from_config(
            {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 8}
        )
    with pytest.raises(
        UnknownModelError, match="num_attention_heads 8 is not a multiple of num_key_value_heads 3"
    ):
        resolve_model(str(_write_config(tmp_path / "bad-gqa", num_key_value_heads=3)))
