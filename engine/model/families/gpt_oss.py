"""gpt-oss: attention sinks, alternating sliding and full layers, YaRN rotary, clamped SwiGLU experts.

Where it sits: registered in the architecture registry (``engine/model/registry.py``) when
``families/__init__`` is imported; its model is ``engine/model/gpt_oss.py``. Read here as
transformers reads ``GptOssConfig``: ``layer_types`` (``sliding_attention`` layers take
``sliding_window``, 128 in the releases), ``attention_bias`` (q/k/v and o), ``head_dim`` apart from
hidden/heads, ``num_local_experts`` experts of ``intermediate_size``, ``num_experts_per_tok`` of them per
token (top-k of the router's logits, then a softmax over those), ``swiglu_alpha`` and ``swiglu_limit``.
The YaRN rotary (``rope_parameters``: factor, beta_fast/slow, truncate) is the shared
``rope_scaling`` parse (``config.py``). MXFP4 expert weights (``quantization_config.quant_method``
``mxfp4``) are dequantized at load (``loader/mxfp4.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.engine.model.families.common import Windows, from_layer_types
from kvfleet.engine.model.families.moe import MoeSpec, _experts
from kvfleet.engine.model.registry import ArchitectureSpec, register_architecture

# The checkpoint's names of each layer's block and its parts: ``mlp.router`` (weight, bias) and
# ``mlp.experts.{gate_up_proj,down_proj}`` (+ ``_bias``) stacked over the experts.
EXPERT_NAMES = ("gate_up_proj", "gate_up_proj", "down_proj")


def _windows(raw: Mapping[str, Any], num_layers: int) -> Windows:
    """``layer_types``'s windows; without it, transformers' default: sliding, full, sliding, ..."""
    if raw.get("layer_types") is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        raw = {**raw, "layer_types": types}
    return from_layer_types(raw, num_layers, 0)


def _gpt_oss(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    experts, top_k = _experts(raw)
    width = int(raw["intermediate_size"])
    moe = MoeSpec(
        experts,
        top_k,
        True,
        width,
        (True,) * num_layers,
        "mlp",
        EXPERT_NAMES,
        router="topk_softmax",
        activation="clamped_swiglu",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        biases=True,
    )
    return {
        "qkv_bias": bool(raw.get("attention_bias", True)),
        "layer_windows": _windows(raw, num_layers),
        "moe": moe,
        "activation": "clamped_swiglu",  # the experts' (checked above), not the shared MLP's silu
    }


register_architecture(
    ArchitectureSpec(
        "GptOssForCausalLM", None, _gpt_oss, model="kvfleet.engine.model.gpt_oss:GptOssForCausalLM"
    )
)
