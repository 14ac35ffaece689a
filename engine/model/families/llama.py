"""Llama 2/3, Mistral and Qwen2: the shared decoder (``engine/model/llama.py``) as it is.

Where it sits: registered in the architecture registry (``engine/model/registry.py``) when
``families/__init__`` is imported. They differ only in q/k/v biases and sliding windows; llama.cpp's
converter permutes the q/k rows of llama and mistral (not qwen2), which the GGUF converter undoes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.engine.model.families.common import every_layer, no_windows, qwen_windows
from kvfleet.engine.model.registry import ArchitectureSpec, register_architecture

QKV_BIASES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias"} | {
    "attn_v.bias": "self_attn.v_proj.bias"
}


def _llama(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    return {"qkv_bias": bool(raw.get("attention_bias", False)), "layer_windows": no_windows(num_layers)}


def _mistral(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    return {"qkv_bias": bool(raw.get("attention_bias", False)), "layer_windows": every_layer(raw, num_layers)}


def _mistral_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    return {"sliding_window": fields.get(f"{arch}.attention.sliding_window")}


def _qwen2(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    return {"qkv_bias": True, "layer_windows": qwen_windows(raw, num_layers)}


register_architecture(ArchitectureSpec("LlamaForCausalLM", "llama", _llama, gguf_permuted_qk=True))
register_architecture(
    ArchitectureSpec(
        "MistralForCausalLM", "mistral", _mistral, gguf_permuted_qk=True, gguf_config=_mistral_gguf
    )
)
register_architecture(
    ArchitectureSpec(
        "Qwen2ForCausalLM", "qwen2", _qwen2, gguf_layer_tensors=QKV_BIASES, gguf_required=tuple(QKV_BIASES)
    )
)
