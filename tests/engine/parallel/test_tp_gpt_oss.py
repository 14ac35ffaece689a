"""gpt-oss at tp=2: each rank holds its heads' sinks and its share of every expert's interleaved
gate/up columns (and of down's rows), and the engine gives transformers' greedy tokens and logprobs
through chunked prefill, prefix hits and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.tp import SliceSpec, slice_for
from kvfleet.engine.parallel.shard import rank_shard

from ..model.gpt_oss_checkpoints import gpt_oss_config, make_gpt_oss_checkpoint
from ..model.moe_checkpoints import assert_equal_to_transformers, engine_outputs


def test_each_rank_reads_its_sinks_and_its_interleaved_share_of_every_expert() -> None:
    raw = gpt_oss_config().to_dict() | {"architectures": ["GptOssForCausalLM"]}
    config = ModelConfig.from_dict(raw)
    layer = "model.layers.1"
    for rank, (heads, inter) in enumerate([(slice(0, 2), slice(0, 32)), (slice(2, 4), slice(32, 64))]):
        shard = rank_shard(config, 2, rank)
        pairs = slice(2 * inter.start, 2 * inter.stop)  # gate column j and up column j sit side by side
        assert slice_for(f"{layer}.self_attn.sinks", shard, config) == SliceSpec(0, heads, 4)
        assert slice_for(f"{layer}.mlp.experts.gate_up_proj", shard, config) == SliceSpec(2, pairs, 128)
        assert slice_for(f"{layer}.mlp.experts.gate_up_proj_bias", shard, config) == SliceSpec(1, pairs, 128)
        assert slice_for(f"{layer}.mlp.experts.down_proj", shard, config) == SliceSpec(1, inter, 64)
        assert slice_for(f"{layer}.mlp.experts.down_proj_bias", shard, config) is None  # whole, on rank 0
        assert slice_for(f"{layer}.mlp.router.weight", shard, config) is None


def test_tp2_gpt_oss_greedy_tokens_and_logprobs_equal_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder: Path = make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt-oss-tp") / "gpt-oss")
    outs, stats = engine_outputs(folder, tp=2)
    assert stats.num_preemptions > 0, "the batch was meant to preempt"
    assert stats.prefix_cache_hits > 0, "the shared prefix was meant to hit"
    assert_equal_to_transformers("gpt-oss tp=2", folder, outs)
