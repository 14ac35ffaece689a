"""The architecture registry (engine/model/registry.py): families by Hugging Face and GGUF name."""

from __future__ import annotations

import pytest

from kvfleet.engine.model.config import ModelConfig, ModelLoadError
from kvfleet.engine.model.llama import LlamaForCausalLM
from kvfleet.engine.model.registry import (
    ArchitectureSpec,
    gguf_architecture,
    known_gguf_architectures,
    model_class,
    register_architecture,
    resolve_architecture,
)


def test_each_family_is_found_by_its_hugging_face_and_its_gguf_name() -> None:
    for hf, gguf in [
        ("LlamaForCausalLM", "llama"),
        ("Qwen2ForCausalLM", "qwen2"),
        ("Qwen3ForCausalLM", "qwen3"),
    ]:
        spec = resolve_architecture([hf])
        assert spec is not None and spec.gguf_name == gguf
        assert gguf_architecture(gguf) is spec
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(known_gguf_architectures())


def test_the_first_registered_name_of_a_configs_architectures_is_taken() -> None:
    spec = resolve_architecture(["SomethingElse", "Qwen3ForCausalLM", "LlamaForCausalLM"])
    assert spec is not None and spec.name == "Qwen3ForCausalLM"
    assert resolve_architecture(["SomethingElse"]) is None


def test_a_second_family_of_a_registered_name_is_refused() -> None:
    with pytest.raises(ValueError, match="architecture 'LlamaForCausalLM' is registered twice"):
        register_architecture(ArchitectureSpec("LlamaForCausalLM"))
    with pytest.raises(ValueError, match="GGUF architecture 'qwen3' is registered twice"):
        register_architecture(ArchitectureSpec("NotQwen3ForCausalLM", "qwen3"))


def test_the_shared_decoder_is_the_model_class_of_the_llama_like_families() -> None:
    spec = resolve_architecture(["Qwen3ForCausalLM"])
    assert spec is not None and model_class(spec) is LlamaForCausalLM


def test_qwen3_config_sets_q_k_norms_without_biases_and_its_own_head_dim() -> None:
    raw = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    }  # fmt: skip
    config = ModelConfig.from_dict(raw)
    assert (config.qk_norm, config.qkv_bias, config.head_dim) == (True, False, 32)
    assert config.layer_windows == (None, None)
    slid = ModelConfig.from_dict(
        raw
        | {
            "use_sliding_window": True,
            "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention"],
        }
    )
    assert slid.layer_windows == (None, 8)


def test_an_unregistered_architecture_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(
        ModelLoadError, match=r"architecture GPT2LMHeadModel is not supported; known .*Qwen3ForCausalLM"
    ):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})
