"""The model's shape and numerics, parsed once from a Hugging Face ``config.json``.

Where it sits: the loader reads ``config.json`` into a :class:`ModelConfig`; the model
(``llama.py``) is built from it; the runner sizes the KV cache from its layer, head and
head-dim counts. Known: the Llama family (Llama 2/3, Mistral, Qwen2) and its mixture-of-experts
kin (Qwen3-MoE, Mixtral: :class:`MoeSpec`, served by ``model/moe.py``); anything else fails here with :class:`ModelLoadError` naming the architecture and the known ones.
Sliding windows are read per layer as transformers reads them: Mistral's ``sliding_window``
on every layer; Qwen2's only with ``use_sliding_window``, on the layers ``layer_types`` marks
``sliding_attention`` (when absent: layers from ``max_window_layers`` on); Llama has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.model.errors import ModelLoadError  # re-exported: raised and caught by that name
from kvfleet.engine.model.rope import ROPE_TYPES, rope_context_len, rope_type

# Architectures served by the one Llama-family model; the value says whether q/k/v have a bias.
KNOWN_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3MoeForCausalLM": False,
    "MixtralForCausalLM": False,
}
# The mixture-of-experts architectures: the checkpoint's name of the block and of its expert linears.
MOE_NAMING: dict[str, tuple[str, tuple[str, str, str]]] = {
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
}
_QWEN2_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default


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
    # Per layer: a query at position p attends keys p - window + 1 .. p (None: all keys 0 .. p).
    layer_windows: tuple[int | None, ...] = ()
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotation (Qwen3)
    moe: MoeSpec | None = None

    @property
    def max_model_len(self) -> int:
        """The longest context served: max_position_embeddings, as far as the rope scaling stretches it."""
        return rope_context_len(self)

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
    num_layers = int(raw["num_hidden_layers"])
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
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
        qkv_bias=KNOWN_ARCHITECTURES[arch] or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope_scaling=_rope_scaling(rope),
        layer_windows=_layer_windows(raw, arch, num_layers),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_ids(raw.get("eos_token_id")),
        qk_norm=arch == "Qwen3MoeForCausalLM",
        moe=_moe(raw, arch, num_layers),
    )


def _moe(raw: dict[str, Any], arch: str, num_layers: int) -> MoeSpec | None:
    """Qwen3-MoE: ``num_experts`` (written ``num_local_experts`` by transformers 5), ``norm_topk_prob``,
    ``moe_intermediate_size``, dense layers by ``mlp_only_layers`` and ``decoder_sparse_step``.
    Mixtral: ``num_local_experts``, always renormalised, experts of ``intermediate_size``, every layer."""
    if arch not in MOE_NAMING:
        return None
    block, names = MOE_NAMING[arch]
    experts = int(raw.get("num_experts") or raw["num_local_experts"])
    top_k = int(raw["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the {experts} experts")
    if arch == "MixtralForCausalLM":
        return MoeSpec(
            experts, top_k, True, int(raw["intermediate_size"]), (True,) * num_layers, block, names
        )
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1))
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    renorm = bool(raw.get("norm_topk_prob", False))
    return MoeSpec(experts, top_k, renorm, int(raw["moe_intermediate_size"]), sparse, block, names)


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Both spellings: ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5).

    As transformers standardises them: a top-level ``original_max_position_embeddings`` wins,
    else llama3 and yarn default it to ``max_position_embeddings``."""
    params = dict(raw.get("rope_parameters") or {})
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


def _layer_windows(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    qwen_off = arch in ("Qwen2ForCausalLM", "Qwen3MoeForCausalLM") and not raw.get(
        "use_sliding_window", False
    )
    if arch == "LlamaForCausalLM" or qwen_off or window is None:
        return (None,) * num_layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} must be a positive integer (tokens) or null")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * num_layers
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", _QWEN2_MAX_WINDOW_LAYERS))
        return tuple(window if i >= first else None for i in range(num_layers))
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers={num_layers}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset({value})
    return frozenset(int(v) for v in value)


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
