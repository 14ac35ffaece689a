"""Gemma 3 (text): interleaved sliding-window and global layers, each with its own rotary base.

Where it sits: registered in the architecture registry (``engine/model/registry.py``) when
``families/__init__`` is imported; its model is ``engine/model/gemma3.py`` (the shared decoder's
layers with Gemma's norms, GeGLU and embedding scale). Read here as transformers reads
``Gemma3TextConfig``: ``layer_types`` (else every ``sliding_window_pattern``-th layer global),
``rope_parameters`` per layer type (or transformers 4's ``rope_theta`` + ``rope_local_base_freq``),
``query_pre_attn_scalar``, ``hidden_activation`` (tanh GELU). Logit soft-capping (Gemma 2's) is refused.

GGUF (llama.cpp's ``gemma3``): the norms around the MLP are ``ffn_norm`` (before) and ``post_ffw_norm``,
after attention ``post_attention_norm``; every norm was stored as 1 + w; the sliding layers are every
layer but each ``sliding_window_pattern``-th (6, llama.cpp's fixed pattern, unless the file says),
rotating with ``rope.freq_base_swa`` (10000 unless the file says); the attention scale is
1/sqrt(head_dim) as llama.cpp computes it for every size but 27B, whose GGUF is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.engine.model.families.common import window_size
from kvfleet.engine.model.registry import ArchitectureSpec, register_architecture

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _windows(raw: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = window_size(raw)
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
        ]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers={num_layers}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _local_theta(raw: Mapping[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params, Mapping) else None
    if isinstance(local, Mapping):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise ValueError(
                f"rope_parameters.sliding_attention.rope_type={kind!r} is not supported; only 'default'"
            )
        return float(local.get("rope_theta", 10000.0))
    return float(raw.get("rope_local_base_freq", 10000.0))


def _gemma3(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ValueError(f"hidden_activation={act!r} is not supported; only {GELU_TANH[0]!r}")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(cap) is not None:
            raise ValueError(f"{cap}={raw[cap]!r} is not supported; only null")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported; only causal attention")
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    return {
        "qkv_bias": bool(raw.get("attention_bias", False)),
        "qk_norm": True,
        "layer_windows": _windows(raw, num_layers),
        "local_rope_theta": _local_theta(raw),
        "activation": "gelu_tanh",
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or head_dim),
    }


GGUF_LAYER = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _gguf_fields(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    hidden, heads = int(fields[f"{arch}.embedding_length"]), int(fields[f"{arch}.attention.head_count"])
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
    if int(fields[f"{arch}.block_count"]) == 62 and hidden == 5376:
        raise ValueError("Gemma 3 27B's GGUF scales attention by hidden/heads: not supported")
    return {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": fields.get(f"{arch}.attention.sliding_window"),
        "sliding_window_pattern": int(fields.get(f"{arch}.attention.sliding_window_pattern") or 6),
        "rope_local_base_freq": float(fields.get(f"{arch}.rope.freq_base_swa") or 10000.0),
        "query_pre_attn_scalar": head_dim,
    }


register_architecture(
    ArchitectureSpec(
        "Gemma3ForCausalLM",
        "gemma3",
        _gemma3,
        model="kvfleet.engine.model.gemma3:Gemma3ForCausalLM",
        gguf_layer_tensors=GGUF_LAYER,
        gguf_required=tuple(k for k in GGUF_LAYER if k != "ffn_norm.weight"),
        gguf_config=_gguf_fields,
        gguf_norm_shift=1.0,
    )
)
