"""A mixture-of-experts config.json that cannot be served, or LoRA on one, is a ModelLoadError naming the
field or the architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine import LLM
from kvfleet.engine.loader.hf_loader import build_model
from kvfleet.engine.model.config import ModelConfig, ModelLoadError
from kvfleet.engine.model.moe import MoeForCausalLM

from .moe_checkpoints import make_moe_checkpoint

QWEN3_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 259, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
}  # fmt: skip


def test_more_experts_per_token_than_experts_is_named() -> None:
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok=9 must be between 1 and the 8 experts"):
        ModelConfig.from_dict({**QWEN3_MOE, "num_experts_per_tok": 9})


def test_a_missing_expert_width_is_named() -> None:
    raw = {k: v for k, v in QWEN3_MOE.items() if k != "moe_intermediate_size"}
    with pytest.raises(ModelLoadError, match=r"field 'moe_intermediate_size' is missing"):
        ModelConfig.from_dict(raw)


def test_decoder_sparse_step_and_mlp_only_layers_pick_the_dense_layers() -> None:
    config = ModelConfig.from_dict(
        {**QWEN3_MOE, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    assert config.moe is not None and config.moe.sparse_layers == (False, True, False, False, False, True)


def test_lora_on_a_moe_model_is_refused_at_start_naming_the_architecture(tmp_path: Path) -> None:
    folder = make_moe_checkpoint("mixtral", tmp_path / "mixtral")
    with pytest.raises(
        ModelLoadError, match=r"not supported on a mixture-of-experts model \(MixtralForCausalLM\)"
    ):
        LLM(str(folder), enable_lora=True, num_kv_blocks=16)


def test_a_moe_model_says_why_it_takes_no_native_decode_call() -> None:
    config = ModelConfig.from_dict(QWEN3_MOE)
    model = build_model(config)
    assert isinstance(model, MoeForCausalLM), "the registry's model class for Qwen3MoeForCausalLM"
    assert (
        model.no_native_layer()
        == "Qwen3MoeForCausalLM's sparse experts are not part of the native decode call"
    )
    assert model.fused_decode() is None
