"""The capacity maths (``kvfleet.capacity``) of a mixture of experts against the models themselves:
its parameter count is transformers' model's, and its biggest tp=2 rank is the engine's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfleet.capacity import model_shape_from_config, per_rank_params
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.moe import MoeForCausalLM
from kvfleet.engine.parallel.shard import rank_shard

from .moe_checkpoints import make_moe_checkpoint


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
def test_capacity_counts_the_parameters_transformers_and_each_engine_rank_hold(
    variant: str, tmp_path: Path
) -> None:
    folder = make_moe_checkpoint(variant, tmp_path / variant)
    raw = json.loads((folder / "config.json").read_text())
    shape = model_shape_from_config(raw)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert shape.num_params == sum(p.numel() for p in hf.parameters())
    config = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        ranks = [MoeForCausalLM(config, rank_shard(config, 2, r)) for r in (0, 1)]
    assert per_rank_params(shape, 2) == max(sum(p.numel() for p in m.parameters()) for m in ranks)
