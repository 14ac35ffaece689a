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


def _checkpoint_and_model(variant: str, folder: Path) -> tuple[Path, type[torch.nn.Module]]:
    """``variant``'s tiny checkpoint saved in ``folder`` and the engine's model class for it."""
    if variant == "gpt-oss":
        from kvfleet.engine.model.gpt_oss import GptOssForCausalLM

        from .gpt_oss_checkpoints import make_gpt_oss_checkpoint

        return make_gpt_oss_checkpoint(folder), GptOssForCausalLM
    return make_moe_checkpoint(variant, folder), MoeForCausalLM


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral", "gpt-oss"])
def test_capacity_counts_the_parameters_transformers_and_each_engine_rank_hold(
    variant: str, tmp_path: Path
) -> None:
    folder, model_class = _checkpoint_and_model(variant, tmp_path / variant)
    raw = json.loads((folder / "config.json").read_text())
    shape = model_shape_from_config(raw)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert shape.num_params == sum(p.numel() for p in hf.parameters())
    config = ModelConfig.from_dict(raw)
    with torch.device("meta"):
        ranks = [model_class(config, rank_shard(config, 2, r)) for r in (0, 1)]
    assert per_rank_params(shape, 2) == max(sum(p.numel() for p in m.parameters()) for m in ranks)


def test_the_gpt_oss_20b_catalog_entry_counts_its_published_total_and_active_parameters() -> None:
    from kvfleet.capacity.catalog import resolve_model

    shape = resolve_model("gpt-oss-20b")
    # OpenAI's model card: 20.9B parameters in all, 3.6B active per token (the card leaves out the
    # embedding table, a lookup; active_params counts it, as for every model here)
    embedding = shape.vocab_size * shape.hidden_size
    assert round(shape.num_params / 1e9, 1) == 20.9
    assert round((shape.active_params - embedding) / 1e9, 1) == 3.6
