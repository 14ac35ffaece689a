"""The mixture-of-experts families: Qwen3-MoE and Mixtral, the shared attention with sparse experts.

Where it sits: registered in the architecture registry (``engine/model/registry.py``) when
``families/__init__`` is imported; their model class is ``engine/model/moe.py``'s
``MoeForCausalLM``, whose feed-forward (``engine/layers/moe``) a :class:`MoeSpec` shapes.
Qwen3-MoE has Qwen3's per-head q/k norms and Qwen2's windows; Mixtral is Mistral with experts.
No GGUF architecture yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.engine.model.families.common import every_layer, qwen_windows
from kvfleet.engine.model.registry import ArchitectureSpec, register_architecture

MOE_MODEL = "kvfleet.engine.model.moe:MoeForCausalLM"


@dataclass(frozen=True)
class MoeSpec:
    """A sparse mixture-of-experts feed-forward: a softmax router picks ``top_k`` of ``num_experts``
    SwiGLU experts per token (weights renormalised to sum 1 where ``renormalize``)."""

    num_experts: int
    top_k: int
    renormalize: bool
    expert_intermediate_size: int
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP (intermediate_size)
    block_name: str  # the checkpoint's module name: ``mlp`` (Qwen3-MoE), ``block_sparse_moe`` (Mixtral)
    linear_names: tuple[str, str, str]  # each expert's gate, up, down linear as the checkpoint names them


def _experts(raw: Mapping[str, Any]) -> tuple[int, int]:
    experts = int(raw.get("num_experts") or raw["num_local_experts"])
    top_k = int(raw["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the {experts} experts")
    return experts, top_k


def _qwen3_moe(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """``num_experts`` (written ``num_local_experts`` by transformers 5), ``norm_topk_prob``,
    ``moe_intermediate_size``; dense layers by ``mlp_only_layers`` and ``decoder_sparse_step``."""
    experts, top_k = _experts(raw)
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1))
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    renorm = bool(raw.get("norm_topk_prob", False))
    names = ("gate_proj", "up_proj", "down_proj")
    moe = MoeSpec(experts, top_k, renorm, int(raw["moe_intermediate_size"]), sparse, "mlp", names)
    return {
        "qkv_bias": bool(raw.get("attention_bias", False)),
        "qk_norm": True,
        "layer_windows": qwen_windows(raw, num_layers),
        "moe": moe,
    }


def _mixtral(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """``num_local_experts``, always renormalised, experts of ``intermediate_size``, every layer."""
    experts, top_k = _experts(raw)
    width = int(raw["intermediate_size"])
    moe = MoeSpec(experts, top_k, True, width, (True,) * num_layers, "block_sparse_moe", ("w1", "w3", "w2"))
    return {
        "qkv_bias": bool(raw.get("attention_bias", False)),
        "layer_windows": every_layer(raw, num_layers),
        "moe": moe,
    }


register_architecture(
    ArchitectureSpec(
        "Qwen3MoeForCausalLM",
        None,
        _qwen3_moe,
        model=MOE_MODEL,
    )
)
register_architecture(ArchitectureSpec("MixtralForCausalLM", None, _mixtral, model=MOE_MODEL))
