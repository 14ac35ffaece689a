"""Qwen3-MoE and Mixtral through the whole engine (``kvfleet.engine.LLM``) against transformers:
16 prompts x 32 greedy tokens with chunked prefill, prefix-cache hits and preemption forced, and
the sampled tokens' logprobs within 1e-4 of transformers' own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.moe import MoeForCausalLM, SparseMoeBlock
from kvfleet.engine.outputs import RequestOutput

from .moe_checkpoints import MOE_VARIANTS, make_moe_checkpoint

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
SYSTEM = [256] + list(range(60, 80))  # a 21-token prefix shared by half the prompts
PROMPTS = [
    SYSTEM + [72 + i, 101, 108 + i] if i % 2 == 0 else [256] + list(range(3 * i, 3 * i + 2 + i))
    for i in range(16)
]
# 16-token steps (chunked prefill), 4-token blocks, too few for all 16 sequences (preemption).
ENGINE: dict[str, Any] = dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=16, max_num_seqs=16)
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {v: make_moe_checkpoint(v, root / v) for v in MOE_VARIANTS}


def hf_eager(folder: Path) -> Any:
    """transformers' model with its eager experts (one expert at a time, its reference loop): the
    default ``grouped_mm`` wants 16-byte strides, which Mixtral's odd intermediate size is not."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def engine_outputs(folder: Path) -> tuple[list[RequestOutput], Any]:
    llm = LLM(str(folder), **ENGINE)
    first = llm.generate(PROMPTS[:1], GREEDY)  # warms the prefix cache with SYSTEM
    return first + llm.generate(PROMPTS[1:], GREEDY), llm.engine.stats()


def hf_tokens_and_logprobs(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0,
    )  # fmt: skip
    tokens = [int(t) for t in out[0, len(prompt) :]]
    with torch.no_grad():
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, logprobs.tolist()


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
    model = hf_eager(folder)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True)):
        want, want_lp = hf_tokens_and_logprobs(model, prompt)
        assert out.outputs[0].token_ids == want, f"{variant}: prompt {i}"
        got_lp = [lp.logprob for lp in out.outputs[0].logprobs or []]
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=0, atol=LOGPROB_TOL)


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
