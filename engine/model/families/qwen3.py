"""Qwen3 (dense): the shared decoder with a per-head RMSNorm on q and k before the rotary.

Where it sits: registered in the architecture registry (``engine/model/registry.py``) when
``families/__init__`` is imported; the shared decoder (``engine/model/llama.py``) builds the
q/k norms where ``ModelConfig.qk_norm`` is set. Its ``head_dim`` is its own (not hidden/heads),
q/k/v carry no bias unless ``attention_bias``; windows as Qwen2's. In GGUF (llama.cpp's ``qwen3``)
the q/k rows are not permuted and the norms are ``attn_q_norm`` / ``attn_k_norm``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvfleet.engine.model.families.common import qwen_windows
from kvfleet.engine.model.registry import ArchitectureSpec, register_architecture

QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}


def _qwen3(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    return {
        "qkv_bias": bool(raw.get("attention_bias", False)),
        "qk_norm": True,
        "layer_windows": qwen_windows(raw, num_layers),
    }


register_architecture(
    ArchitectureSpec(
        "Qwen3ForCausalLM", "qwen3", _qwen3, gguf_layer_tensors=QK_NORMS, gguf_required=tuple(QK_NORMS)
    )
)
