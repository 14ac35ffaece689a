"""The capacity maths' catalogue (docs/architecture.md §4): GPUs, model shapes, dtypes; torch-free.

What :mod:`kvfleet.capacity` computes with: a GPU's datasheet figures, a model's shape from a
Hugging Face ``config.json`` or a known name, the bytes of a dtype, and the errors naming a bad
value. :mod:`kvfleet.capacity` exports every public name here, so callers import from there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30


class CapacityError(ValueError):
    """Bad input to the capacity maths: the message names the value and what is allowed."""


class UnknownGPUError(CapacityError):
    pass


class UnknownModelError(CapacityError):
    pass


class UnknownDtypeError(CapacityError):
    pass


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    bf16_flops: float  # dense (no sparsity) tensor-core bf16


# Public datasheet figures. HBM/GDDR "GB" on a datasheet is binary in practice (an H100's
# "80 GB" reports 79.6 GiB, an H200's "141 GB" 140.4 GiB), so memory is counted in GiB;
# bandwidth and FLOP/s are decimal, as datasheets state them.
GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("H100 SXM 80GB", 80 * GIB, 3.35e12, 989e12),
    "h200": GPUSpec("H200 SXM 141GB", 141 * GIB, 4.8e12, 989e12),
    "a100": GPUSpec("A100 SXM 80GB", 80 * GIB, 2.039e12, 312e12),
    "a100-40gb": GPUSpec("A100 SXM 40GB", 40 * GIB, 1.555e12, 312e12),
    "l4": GPUSpec("L4 24GB", 24 * GIB, 300e9, 121e12),
    "l40s": GPUSpec("L40S 48GB", 48 * GIB, 864e9, 362e12),
    "a10g": GPUSpec("A10G 24GB", 24 * GIB, 600e9, 125e12),
}
_GPU_ALIASES = {"h100-80gb": "h100", "h100-sxm": "h100", "h200-141gb": "h200", "a100-80gb": "a100"}


def resolve_gpu(name: str) -> GPUSpec:
    """The catalogue entry for ``name``, case-insensitive (``H100``, ``a100-80gb``)."""
    key = name.strip().lower()
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise UnknownGPUError(f"unknown GPU {name!r}: known GPUs are {', '.join(GPUS)}")
    return GPUS[key]


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    # Mixture of experts (Qwen3-MoE, Mixtral): ``sparse_layers`` of the layers hold ``num_experts``
    # SwiGLU experts of ``expert_intermediate_size`` and a router (E x hidden), each token running
    # ``experts_per_token`` of them; the other layers a dense MLP of ``intermediate_size``.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    sparse_layers: int = 0
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each q and k head
    sandwich_norms: bool = False  # Gemma 3: norms after attention and before and after the MLP too
    # gpt-oss: a bias on o_proj too, a sink logit per head, biases on the router and every expert matmul
    o_bias: bool = False
    attention_sinks: bool = False
    expert_biases: bool = False
    # Sliding-window attention (Gemma 3's local layers, Mistral's every layer): ``sliding_layers`` of
    # the layers keep only the last ``sliding_window`` tokens' KV (the engine frees the rest).
    sliding_window: int | None = None
    sliding_layers: int = 0

    @property
    def num_params(self) -> int:
        """Parameters of a Llama-family decoder: embeddings, GQA attention, SwiGLU MLP (every expert of
        a sparse layer, and its router), RMSNorms, lm_head."""
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: :attr:`num_params` with ``experts_per_token`` experts per
        sparse layer (the router whole); a dense model's are all of them."""
        return self._params(self.experts_per_token)

    def _params(self, experts: int) -> int:
        h, q_width, kv_width = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attention = h * q_width + 2 * h * kv_width + q_width * h
        if self.attention_bias:
            attention += q_width + 2 * kv_width
        attention += (h if self.o_bias else 0) + (self.num_heads if self.attention_sinks else 0)
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        sparse = experts * 3 * h * self.expert_intermediate_size + self.num_experts * h  # + router
        if self.expert_biases:  # gate/up and down biases of each expert, the router's
            sparse += experts * (2 * self.expert_intermediate_size + h) + self.num_experts
        norms = (4 if self.sandwich_norms else 2) * h + (2 * self.head_dim if self.qk_norm else 0)  # (+ q/k)
        dense_layers = self.num_layers - self.sparse_layers
        layers = self.num_layers * (attention + norms) + dense_layers * mlp + self.sparse_layers * sparse
        embeddings = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return layers + embeddings + lm_head + h  # + final norm


def _llama3(
    name: str, layers: int, hidden: int, heads: int, inter: int, tied: bool, max_pos: int
) -> ModelShape:
    head_dim = hidden // heads
    return ModelShape(name, layers, hidden, heads, 8, head_dim, inter, 128256, tied, max_pos)


KNOWN_MODELS: dict[str, ModelShape] = {
    "llama-3-8b": _llama3("llama-3-8b", 32, 4096, 32, 14336, False, 8192),
    "llama-3-70b": _llama3("llama-3-70b", 80, 8192, 64, 28672, False, 8192),
    "llama-3.2-1b": _llama3("llama-3.2-1b", 16, 2048, 32, 8192, True, 131072),
    "qwen2-7b": ModelShape(
        "qwen2-7b", 28, 3584, 28, 4, 128, 18944, 152064, False, 32768, attention_bias=True
    ),
    "mistral-7b": ModelShape("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000, False, 32768),
    "qwen3-8b": ModelShape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, False, 40960, qk_norm=True),
    # Gemma 3: 22 sliding layers (window 512) and 4 global ones (each 6th); the sliding ones hold 512 tokens' KV.
    "gemma-3-1b": ModelShape(
        "gemma-3-1b",
        26,
        1152,
        4,
        1,
        256,
        6912,
        262144,
        True,
        32768,
        qk_norm=True,
        sandwich_norms=True,
        sliding_window=512,
        sliding_layers=22,
    ),  # fmt: skip
    # mixtures of experts: every expert counts in the weights, experts_per_token of them run per token
    "mixtral-8x7b": ModelShape(
        "mixtral-8x7b",
        32,
        4096,
        32,
        8,
        128,
        14336,
        32000,
        False,
        32768,
        num_experts=8,
        experts_per_token=2,
        expert_intermediate_size=14336,
        sparse_layers=32,
    ),
    "qwen3-30b-a3b": ModelShape(
        "qwen3-30b-a3b",
        48,
        2048,
        32,
        4,
        128,
        6144,
        151936,
        False,
        40960,
        qk_norm=True,
        num_experts=128,
        experts_per_token=8,
        expert_intermediate_size=768,
        sparse_layers=48,
    ),
    # gpt-oss: every layer sparse, experts as wide as the hidden size, q/k/v/o biases and sinks
    "gpt-oss-20b": ModelShape(
        "gpt-oss-20b",
        24,
        2880,
        64,
        8,
        64,
        2880,
        201088,
        False,
        131072,
        attention_bias=True,
        o_bias=True,
        attention_sinks=True,
        expert_biases=True,
        num_experts=32,
        experts_per_token=4,
        expert_intermediate_size=2880,
        sparse_layers=24,
        sliding_window=128,  # layer_types: sliding and full attention alternate
        sliding_layers=12,
    ),
}
_MODEL_ALIASES = {
    "meta-llama-3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b",
    "mistral-7b-v0.1": "mistral-7b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
}

_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "mixtral", "gpt_oss"}


def _int_field(config: Mapping[str, Any], key: str, name: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnknownModelError(
            f"model {name!r}: config field {key!r} must be a positive integer, got {value!r}"
        )
    return value


def model_shape_from_config(config: Mapping[str, Any], name: str = "custom") -> ModelShape:
    """The shape of a Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text), Qwen3-MoE, Mixtral or gpt-oss model
    from its ``config.json`` dict."""
    model_type = config.get("model_type", "llama")
    if model_type not in _ARCHITECTURES:
        raise UnknownModelError(
            f"model {name!r}: model_type {model_type!r} is not supported (supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    hidden = _int_field(config, "hidden_size", name)
    heads = _int_field(config, "num_attention_heads", name)
    kv_heads = _int_field(config, "num_key_value_heads", name, default=heads)
    if heads % kv_heads:
        raise UnknownModelError(
            f"model {name!r}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = config.get("head_dim") or (hidden // heads)
    return ModelShape(
        name=name,
        num_layers=_int_field(config, "num_hidden_layers", name),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_int_field({"head_dim": head_dim}, "head_dim", name),
        intermediate_size=_int_field(config, "intermediate_size", name),
        vocab_size=_int_field(config, "vocab_size", name),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=_int_field(config, "max_position_embeddings", name, default=2048),
        attention_bias=bool(config.get("attention_bias", model_type in ("qwen2", "gpt_oss"))),
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        sandwich_norms=model_type == "gemma3_text",
        o_bias=model_type == "gpt_oss" and bool(config.get("attention_bias", True)),
        attention_sinks=model_type == "gpt_oss",
        expert_biases=model_type == "gpt_oss",
        **_experts(config, model_type, name),
        **_windows(config, model_type, name),
    )


def _windows(config: Mapping[str, Any], model_type: str, name: str) -> dict[str, int]:
    """The sliding layers and their window, as ``engine/model/families`` reads them (Qwen2's
    ``max_window_layers`` without ``layer_types`` is counted as full attention: never under)."""
    window = config.get("sliding_window")
    if window is None or (model_type.startswith("qwen") and not config.get("use_sliding_window")):
        return {}
    window = _int_field(config, "sliding_window", name)
    layers = _int_field(config, "num_hidden_layers", name)
    types = config.get("layer_types")
    if types:
        sliding = sum(1 for t in types if t == "sliding_attention")
    elif model_type == "gemma3_text":  # every pattern-th layer global (6, as llama.cpp and transformers)
        pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
        sliding = sum(1 for i in range(layers) if (i + 1) % pattern)
    elif model_type in ("mistral", "mixtral"):
        sliding = layers
    else:
        return {}
    return {"sliding_window": window, "sliding_layers": sliding} if sliding else {}


def _experts(config: Mapping[str, Any], model_type: str, name: str) -> dict[str, int]:
    """The mixture-of-experts fields (none for a dense model), read as ``engine/model/config.py`` reads them."""
    if model_type not in ("qwen3_moe", "mixtral", "gpt_oss"):
        return {}
    key = "num_experts" if config.get("num_experts") else "num_local_experts"
    layers = _int_field(config, "num_hidden_layers", name)
    if model_type in ("mixtral", "gpt_oss"):
        inter, sparse = _int_field(config, "intermediate_size", name), layers
    else:
        inter = _int_field(config, "moe_intermediate_size", name)
        dense, step = set(config.get("mlp_only_layers") or []), int(config.get("decoder_sparse_step", 1))
        sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return {
        "num_experts": _int_field(config, key, name),
        "experts_per_token": _int_field(config, "num_experts_per_tok", name),
        "expert_intermediate_size": inter,
        "sparse_layers": sparse,
    }


def _load_config(path: Path) -> ModelShape:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UnknownModelError(f"model folder {str(path)!r} holds no config.json")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnknownModelError(f"cannot read model config {str(file)!r}: {exc}") from exc
    if not isinstance(config, dict):
        raise UnknownModelError(f"model config {str(file)!r} is not a JSON object")
    name = file.parent.name if file.name == "config.json" else file.stem
    return model_shape_from_config(config, name=name or "custom")


def resolve_model(name_or_path: str) -> ModelShape:
    """A known model name (case-insensitive, ``meta-llama/Meta-Llama-3-8B`` too) or a config.json path or folder."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return _load_config(path)
    key = name_or_path.strip().lower().rsplit("/", 1)[-1]
    key = _MODEL_ALIASES.get(key, key)
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    raise UnknownModelError(
        f"unknown model {name_or_path!r}: not a config.json or a folder holding one, "
        f"nor a known name ({', '.join(KNOWN_MODELS)})"
    )


DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def canonical_dtype(dtype: str) -> str:
    """The DTYPE_BYTES key for ``dtype`` (``bf16`` → ``bfloat16``)."""
    key = dtype.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise UnknownDtypeError(f"unknown dtype {dtype!r}: known dtypes are {', '.join(DTYPE_BYTES)}")
    return key
