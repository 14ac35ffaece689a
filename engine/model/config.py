"""The model's shape and numerics, parsed once from a Hugging Face ``config.json``.

Where it sits: the loader reads ``config.json`` into a :class:`ModelConfig`; the model
(``llama.py``) is built from it; the runner sizes the KV cache from its layer, head and
head-dim counts. Only the Llama family is known (Llama 2/3, Mistral, Qwen2); anything
else fails here with :class:`ModelLoadError` naming the architecture and the known ones.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Architectures served by the one Llama-family model; the value says whether q/k/v have a bias.
KNOWN_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(RuntimeError):
    """A model folder that cannot be served: the message names the file (and the field)."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None  # Mistral v0.1: attention never looks further back
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def max_model_len(self) -> int:
        """The longest context served exactly (a sliding window caps it: no windowed attention here)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _dtype_bytes(dtype)

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        if not path.is_file():
            raise ModelLoadError(f"{path}: config.json is missing")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = _architecture(raw, source)
        try:
            return _parse(raw, arch)
        except KeyError as e:
            raise ModelLoadError(f"{source}: field {e.args[0]!r} is missing (architecture {arch})") from e
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: {e}") from e


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    known = sorted(KNOWN_ARCHITECTURES)
    for arch in archs:
        if arch in KNOWN_ARCHITECTURES:
            return str(arch)
    named = ", ".join(archs) if archs else "none given"
    raise ModelLoadError(f"{source}: architecture {named} is not supported; known architectures: {known}")


def _parse(raw: dict[str, Any], arch: str) -> ModelConfig:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = int(raw.get("head_dim") or hidden // heads)
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={raw['hidden_act']!r} is not supported; only 'silu'")
    rope = _rope(raw)
    window = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        window = None
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=KNOWN_ARCHITECTURES[arch] or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope_scaling=_rope_scaling(rope),
        sliding_window=int(window) if window else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_ids(raw.get("eos_token_id")),
    )


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Both spellings: ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    if "rope_theta" in raw:
        merged.setdefault("rope_theta", raw["rope_theta"])
    return merged


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; known: {list(ROPE_TYPES)}")
    if kind == "default":
        return None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = kind
    return scaling


def _ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    return frozenset(int(v) for v in value)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies in float32, with the checkpoint's scaling, as transformers computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Invariant: wavelengths shorter than old_len/high_freq_factor keep their frequency, longer
    # than old_len/low_freq_factor are divided by factor, and those between blend smoothly.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
