"""Tiny checkpoints for tensor parallelism: every way a tp=2 split can go (even, uneven, replicated, tied, biased)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig

from ..model.conftest import BIASES, COMMON, make_checkpoint, save_checkpoint

# 6 query heads over 3 KV heads (tp=2: {0,1}+4 heads, {2}+2), intermediate 161 and vocabulary 259
# (both odd: uneven columns), and every bias (q/k/v, o_proj, gate/up, down_proj: row-parallel ones too).
UNEVEN: dict[str, Any] = {
    **COMMON,
    "intermediate_size": 161,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "hidden_size": 96,
    "head_dim": 16,
    "attention_bias": True,
    "mlp_bias": True,
}


def make_uneven(folder: Path) -> Path:
    return save_checkpoint(LlamaConfig(**UNEVEN), folder, "uneven", (BIASES,), seed=1)


@pytest.fixture(scope="session")
def tp_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    made = {
        v: make_checkpoint(v, root / v)
        for v in ("llama-gqa-llama3-sharded", "mistral-mqa", "qwen2-tied", "qwen3-window", "gemma3-window")
    }
    made["llama-uneven-biased"] = make_uneven(root / "llama-uneven-biased")
    return made
