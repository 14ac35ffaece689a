"""The model's shape and numerics, parsed once from a Hugging Face ``config.json``.

Where it sits: the loader reads ``config.json`` into a :class:`ModelConfig`; the model
(the family's class, ``llama.py`` for most) is built from it; the runner sizes the KV cache from its
layer, head and head-dim counts. The architecture is resolved in the registry
(``registry.py``); one it does not know fails here with :class:`ModelLoadError` naming the
architecture and the known ones. The shared fields are parsed here, each family's own (q/k/v
biases, q/k norms, sliding windows per layer, as transformers reads them) by its registry hook
(``families/*.py``; the mixture-of-experts families' :class:`MoeSpec` by ``families/moe.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfleet.engine.model.errors import ModelLoadError  # re-exported: raised and caught by that name
from kvfleet.engine.model.families.moe import MoeSpec  # re-exported: the MoE model takes it here
from kvfleet.engine.model.registry import ArchitectureSpec, known_architectures, resolve_architecture
from kvfleet.engine.model.rope_scaling import ROPE_TYPES, rope_context_len, rope_type

if (
    TYPE_CHECKING
):  # annotations only: this module never imports torch (tests/engine/model/test_config_is_torch_free.py)
    import torch


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
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each q and k head before the rotary
    # Gemma 3: the sliding layers' own rotary base (unscaled); the MLP's activation; the attention
    # scale's 1/sqrt(query_pre_attn_scalar) (None: 1/sqrt(head_dim)).
    local_rope_theta: float | None = None
    activation: str = "silu"
    query_pre_attn_scalar: float | None = None
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    # Per layer: a query at position p attends keys p - window + 1 .. p (None: all keys 0 .. p).
    layer_windows: tuple[int | None, ...] = ()
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    moe: MoeSpec | None = None  # Qwen3-MoE, Mixtral: the sparse feed-forward (``model/moe.py``)

    @property
    def max_model_len(self) -> int:
        """The longest context served: max_position_embeddings, as far as the rope scaling stretches it."""
        return rope_context_len(self)

    @property
    def kv_window(self) -> int | None:
        """The widest window where every layer slides (blocks before it can be freed); None where
        some layer attends to every key (Llama's, Gemma 3's global layers)."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(w for w in self.layer_windows if w is not None)

    def layer_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

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
        spec = _architecture(raw, source)
        try:
            return _parse(raw, spec)
        except KeyError as e:
            raise ModelLoadError(
                f"{source}: field {e.args[0]!r} is missing (architecture {spec.name})"
            ) from e
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: {e}") from e


def _architecture(raw: dict[str, Any], source: str) -> ArchitectureSpec:
    archs = raw.get("architectures") or []
    spec = resolve_architecture(list(archs))
    if spec is not None:
        return spec
    known = known_architectures()
    named = ", ".join(archs) if archs else "none given"
    raise ModelLoadError(f"{source}: architecture {named} is not supported; known architectures: {known}")


def _parse(raw: dict[str, Any], spec: ArchitectureSpec) -> ModelConfig:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = int(raw.get("head_dim") or hidden // heads)
    rope = _rope(raw)
    num_layers = int(raw["num_hidden_layers"])
    family = spec.config(raw, num_layers)
    if family.get("activation", "silu") == "silu" and raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={raw['hidden_act']!r} is not supported; only 'silu'")
    return ModelConfig(
        architecture=spec.name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope_scaling=_rope_scaling(rope),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_ids(raw.get("eos_token_id")),
        **family,
    )


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Both spellings: ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5);
    per layer type (Gemma 3's ``rope_parameters``), the full-attention layers' (the sliding ones'
    is the family's ``local_rope_theta``).

    As transformers standardises them: a top-level ``original_max_position_embeddings`` wins,
    else llama3 and yarn default it to ``max_position_embeddings``."""
    params = dict(raw.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    if "rope_theta" in raw:
        merged.setdefault("rope_theta", raw["rope_theta"])
    if (merged.get("rope_type") or merged.get("type")) in ("llama3", "yarn"):
        if raw.get("original_max_position_embeddings") is not None:
            merged["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        merged.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    return merged


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    spec = rope_type(kind)
    if spec is None:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")
    missing = [name for name in spec.required if rope.get(name) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} needs field {missing[0]!r}, which is missing")
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported; only 1.0 (rope on every dim)")
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
    return int(dtype.itemsize)
