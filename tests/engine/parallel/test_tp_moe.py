"""Qwen3-MoE and Mixtral at tp=2 (every expert's intermediate columns split, Mixtral's 161 unevenly)
give transformers' greedy tokens and logprobs through chunked prefill, prefix hits and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.moe import expert_columns
from kvfleet.engine.parallel.shard import rank_shard

from ..model.moe_checkpoints import assert_equal_to_transformers, engine_outputs, make_moe_checkpoint


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
def test_tp2_moe_greedy_tokens_and_logprobs_equal_transformers(
    variant: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = make_moe_checkpoint(variant, tmp_path_factory.mktemp("moe-tp") / variant)
    outs, stats = engine_outputs(folder, tp=2)
    assert stats.num_preemptions > 0, "the batch was meant to preempt"
    assert stats.prefix_cache_hits > 0, "the shared prefix was meant to hit"
    assert_equal_to_transformers(f"{variant} tp=2", folder, outs)


def test_each_rank_holds_its_share_of_every_experts_columns(tmp_path: Path) -> None:
    folder = make_moe_checkpoint("mixtral", tmp_path / "mixtral")
    config = ModelConfig.from_file(folder / "config.json")
    assert config.moe is not None
    shares = [expert_columns(config.moe, rank_shard(config, 2, r)) for r in (0, 1)]
    assert shares == [81, 80]
