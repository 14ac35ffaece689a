"""Qwen3-MoE and Mixtral through the whole engine (``kvfleet.engine.LLM``) against transformers:
16 prompts x 32 greedy tokens with chunked prefill, prefix-cache hits and preemption forced, and
the sampled tokens' logprobs within 1e-4 of transformers' own."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine import LLM
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.moe import MoeForCausalLM, SparseMoeBlock

from .moe_checkpoints import MOE_VARIANTS, assert_equal_to_transformers, engine_outputs, make_moe_checkpoint


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {v: make_moe_checkpoint(v, root / v) for v in MOE_VARIANTS}


def test_a_moe_config_parses_to_a_moe_spec_with_the_checkpoints_names(
    moe_checkpoints: dict[str, Path],
) -> None:
    qwen = ModelConfig.from_file(moe_checkpoints["qwen3-moe"] / "config.json")
    assert qwen.moe is not None and qwen.qk_norm
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.renormalize) == (8, 2, False)
    assert qwen.moe.sparse_layers == (True, False, True) and qwen.moe.expert_intermediate_size == 40
    mixtral = ModelConfig.from_file(moe_checkpoints["mixtral"] / "config.json")
    assert mixtral.moe is not None and mixtral.moe.renormalize and not mixtral.qk_norm
    assert mixtral.moe.block_name == "block_sparse_moe" and mixtral.moe.linear_names == ("w1", "w3", "w2")


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_greedy_tokens_and_logprobs_equal_transformers_through_chunking_prefix_hits_and_preemption(
    variant: str, moe_checkpoints: dict[str, Path]
) -> None:
    folder = moe_checkpoints[variant]
    outs, stats = engine_outputs(folder)
    assert stats.num_preemptions > 0, "the batch was meant to preempt"
    assert stats.prefix_cache_hits > 0, "the shared prefix was meant to hit"
    assert_equal_to_transformers(variant, folder, outs)


def test_the_sparse_layers_hold_moe_blocks_and_the_dense_layer_an_mlp(
    moe_checkpoints: dict[str, Path],
) -> None:
    llm = LLM(str(moe_checkpoints["qwen3-moe"]), num_kv_blocks=16)
    model = llm.engine.runner.model
    assert isinstance(model, MoeForCausalLM)
    kinds = [type(layer.feed_forward()).__name__ for layer in model.model.layers]
    assert kinds == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]
    block = model.model.layers[0].feed_forward()
    assert isinstance(block, SparseMoeBlock) and block.stacked is not None
    assert tuple(block.stacked.w13.shape) == (8, 80, 64) and tuple(block.stacked.w2.shape) == (8, 64, 40)
