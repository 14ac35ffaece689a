"""gpt-oss through the whole engine (``kvfleet.engine.LLM``) against transformers' ``GptOssForCausalLM``:
16 prompts x 32 greedy tokens with chunked prefill, prefix-cache hits and preemption forced, on the
torch and the native cpu attention backends, the sampled tokens' logprobs within 1e-4 of
transformers' own (``moe_checkpoints.LOGPROB_TOL``); the config read as transformers reads it; the
native one-call decode refused for its sinks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine import LLM
from kvfleet.engine.model.config import ModelConfig, ModelLoadError
from kvfleet.engine.model.gpt_oss import GptOssForCausalLM, GptOssMoeBlock
from kvfleet.engine.outputs import RequestOutput

from .gpt_oss_checkpoints import gpt_oss_config, make_gpt_oss_checkpoint
from .moe_checkpoints import ENGINE, GREEDY, PROMPTS, assert_equal_to_transformers
from .test_runner_hf_equivalence import HandScheduler, make_runner, new_seq


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss")


def serve(folder: Path, **engine: Any) -> tuple[list[RequestOutput], Any]:
    """The engine's outputs for ``PROMPTS`` (the first alone, warming the prefix cache) and its stats."""
    llm = LLM(str(folder), **{**ENGINE, **engine})
    try:
        first = llm.generate(PROMPTS[:1], GREEDY)
        return first + llm.generate(PROMPTS[1:], GREEDY), llm.engine.stats()
    finally:
        llm.close()


def test_the_config_reads_windows_sinks_yarn_biases_and_experts_as_transformers(gpt_oss: Path) -> None:
    config = ModelConfig.from_file(gpt_oss / "config.json")
    assert config.architecture == "GptOssForCausalLM"
    assert config.layer_windows == (8, None, 8) and config.kv_window is None
    assert config.qkv_bias and config.o_bias and config.head_dim == 16
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"
    assert (config.rope_scaling["factor"], config.rope_scaling["truncate"]) == (4.0, False)
    assert config.rope_scaling["original_max_position_embeddings"] == 16
    moe = config.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (8, 2, 64)
    assert (moe.router, moe.activation, moe.biases) == ("topk_softmax", "clamped_swiglu", True)
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 7.0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_and_logprobs_equal_transformers_through_chunking_prefix_hits_and_preemption(
    backend: str, gpt_oss: Path
) -> None:
    outs, stats = serve(gpt_oss, attention_backend=backend)
    assert stats.num_preemptions > 0, "the batch was meant to preempt"
    assert stats.prefix_cache_hits > 0, "the shared prefix was meant to hit"
    assert max(len(p) for p in PROMPTS) > 8, "the prompts were meant to outgrow the window"
    assert_equal_to_transformers(f"gpt-oss on {backend}", gpt_oss, outs)


def test_the_model_holds_sinks_and_biased_experts_and_refuses_the_native_one_call_decode(
    gpt_oss: Path,
) -> None:
    llm = LLM(str(gpt_oss), num_kv_blocks=16)
    try:
        model = llm.engine.runner.model
        assert isinstance(model, GptOssForCausalLM)
        reason = model.no_native_layer()
        assert reason is not None and "attention sinks" in reason
        assert model.fused_decode() is None
        layer = model.model.layers[0]
        assert layer.self_attn.sinks is not None and tuple(layer.self_attn.sinks.shape) == (4,)
        block = layer.feed_forward()
        assert isinstance(block, GptOssMoeBlock)
        stacked = block.experts.stacked()
        assert tuple(stacked.w13.shape) == (8, 128, 64) and tuple(stacked.w2.shape) == (8, 64, 64)
        assert stacked.b13 is not None and stacked.b2 is not None
        # the stacked experts are the checkpoint's tensors seen transposed, not copies
        assert stacked.w13.data_ptr() == block.experts.gate_up_proj.data_ptr()
    finally:
        llm.close()


def test_the_step_dispatcher_routes_gpt_oss_decodes_per_op_naming_the_sinks(gpt_oss: Path) -> None:
    runner, sched = make_runner(gpt_oss, backend="cpu"), HandScheduler()
    route = runner.route(sched.decode_all([new_seq(PROMPTS[1])]))
    assert route.path == "per_op"
    assert "GptOssForCausalLM's attention sinks are not part of the native decode call" in route.reason


def test_without_layer_types_the_layers_alternate_sliding_and_full_as_transformers_default() -> None:
    raw = gpt_oss_config().to_dict() | {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 4}
    del raw["layer_types"]
    assert ModelConfig.from_dict(raw).layer_windows == (8, None, 8, None)
    bad = raw | {"num_experts_per_tok": 9}
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=9 must be between 1 and the 8 experts"):
        ModelConfig.from_dict(bad)


def test_quantizing_gpt_oss_is_refused_naming_the_architecture_and_the_way_it_is_served(
    gpt_oss: Path,
) -> None:
    with pytest.raises(
        ModelLoadError, match="GptOssForCausalLM is not served quantized .*serve it in floats"
    ):
        LLM(str(gpt_oss), quantization="int8", num_kv_blocks=16)
