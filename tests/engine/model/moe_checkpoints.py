"""Tiny random mixture-of-experts checkpoints made with transformers' own config classes
(Qwen3MoeConfig, Mixtral): 8 experts, top-2, a few layers, saved by ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from .conftest import COMMON, write_tokenizer

SHAPE: dict[str, Any] = {**COMMON, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
MOE_VARIANTS: dict[str, Any] = {
    # Qwen3-MoE: per-head q/k norms, experts narrower than the dense MLP, layer 1 dense, no renormalisation.
    "qwen3-moe": lambda: Qwen3MoeConfig(
        **SHAPE,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # Qwen3-MoE renormalising its top-k weights (norm_topk_prob), every layer sparse.
    "qwen3-moe-norm": lambda: Qwen3MoeConfig(
        **SHAPE,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        norm_topk_prob=True,
    ),
    # Mixtral: always renormalised, experts of intermediate_size (an odd 161: uneven at tp=2).
    "mixtral": lambda: MixtralConfig(
        **{**SHAPE, "intermediate_size": 161}, num_local_experts=8, num_experts_per_tok=2
    ),
}


def make_moe_checkpoint(variant: str, folder: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MOE_VARIANTS[variant](), torch_dtype=torch.float32)
    with torch.no_grad():  # decisive routing and q/k norms that count
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, folder.parent / f"{variant}-tok-scratch")
    return folder
