"""The mixture-of-experts families: Qwen3-MoE and Mixtral, the shared attention with sparse experts.

Where it sits: registered in the architecture registry (``engine/model/registry.py``) when
``families/__init__`` is imported; their model class is ``engine/model/moe.py``'s
``MoeForCausalLM``, whose feed-forward (``engine/layers/moe``) a :class:`MoeSpec` shapes.
Qwen3-MoE has Qwen3's per-head q/k norms and Qwen2's windows; Mixtral is Mistral with experts.
In GGUF (llama.cpp's ``qwen3moe``) the experts are stacked 3D tensors ``ffn_{gate,up,down}_exps``
and the router ``ffn_gate_inp``, which the converter splits into the per-expert names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfleet.engine.model.families.common import every_layer, qwen_windows
from kvfleet.engine.model.families.qwen3 import QK_NORMS
from kvfleet.engine.model.registry import ArchitectureSpec, register_architecture

MOE_MODEL = "kvfleet.engine.model.moe:MoeForCausalLM"
# llama.cpp's qwen3moe layer tensors: the router, and the experts stacked (E, out, in) in one tensor
# each, whose Hugging Face name holds ``{}`` for the expert (the converter writes one per expert).
QWEN3MOE_EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
}


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
    # gpt-oss (``families/gpt_oss.py``): its router (``layers/moe/router.py``), its experts'
    # activation (``layers/moe/grouped.py``) with their alpha and limit, and biases on every matmul.
    router: str = "softmax_topk"
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    biases: bool = False


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


def _qwen3_moe_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """llama.cpp's expert metadata as config.json names it (every layer sparse, top-k renormalised
    as Qwen3-MoE's releases are; llama.cpp's qwen3moe always renormalises)."""
    names = {"num_experts": "expert_count", "num_experts_per_tok": "expert_used_count"}
    names["moe_intermediate_size"] = "expert_feed_forward_length"
    missing = [f"{arch}.{key}" for key in names.values() if fields.get(f"{arch}.{key}") is None]
    if missing:
        raise ValueError(f"field {missing[0]} is missing (a {arch} file names its experts)")
    return {hf: int(fields[f"{arch}.{key}"]) for hf, key in names.items()} | {"norm_topk_prob": True}


register_architecture(
    ArchitectureSpec(
        "Qwen3MoeForCausalLM",
        "qwen3moe",
        _qwen3_moe,
        model=MOE_MODEL,
        gguf_layer_tensors=QK_NORMS | QWEN3MOE_EXPERTS,
        gguf_required=(*QK_NORMS, *QWEN3MOE_EXPERTS),
        gguf_config=_qwen3_moe_gguf,
        gguf_dense_mlp=False,
    )
)
register_architecture(ArchitectureSpec("MixtralForCausalLM", None, _mixtral, model=MOE_MODEL))
