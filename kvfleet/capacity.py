"""Capacity maths (docs/architecture.md §4): what fits on which GPU, torch-free.

Shared by ``kvfleet plan`` (the table a user reads before buying GPUs), the engine's
simulated mode (decode cost per step) and the operator (the capacity figures and the
``CapacityFits`` condition of an InferenceService's status). It reads a model's shape
from a Hugging Face ``config.json`` or a known name and a GPU from a small catalogue of
datasheet figures; it never loads weights and imports nothing heavier than the stdlib.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
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

    @property
    def num_params(self) -> int:
        """Parameters of a Llama-family decoder: embeddings, GQA attention, SwiGLU MLP, RMSNorms, lm_head."""
        h, q_width, kv_width = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attention = h * q_width + 2 * h * kv_width + q_width * h
        if self.attention_bias:
            attention += q_width + 2 * kv_width
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        per_layer = attention + mlp + 2 * h  # input and post-attention RMSNorm
        embeddings = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embeddings + lm_head + h  # + final norm


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
}
_MODEL_ALIASES = {
    "meta-llama-3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b",
    "mistral-7b-v0.1": "mistral-7b",
}

_ARCHITECTURES = {"llama", "mistral", "qwen2"}


def _int_field(config: Mapping[str, Any], key: str, name: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnknownModelError(
            f"model {name!r}: config field {key!r} must be a positive integer, got {value!r}"
        )
    return value


def model_shape_from_config(config: Mapping[str, Any], name: str = "custom") -> ModelShape:
    """The shape of a Llama, Mistral or Qwen2 model from its Hugging Face ``config.json`` dict."""
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
        attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
    )


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


def kv_bytes_per_token(shape: ModelShape, dtype: str = "bfloat16") -> int:
    """K and V for one token in every layer: 2 × layers × kv_heads × head_dim × dtype bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[canonical_dtype(dtype)]


def weights_bytes(shape: ModelShape, dtype: str = "bfloat16") -> int:
    """Every parameter once, in ``dtype``."""
    return shape.num_params * DTYPE_BYTES[canonical_dtype(dtype)]


def activation_bytes(
    shape: ModelShape, dtype: str = "bfloat16", *, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256
) -> int:
    """Peak activation memory of one forward step on one GPU (an estimate, as vLLM's profiling run measures).

    A step of T = ``max_num_batched_tokens`` tokens holds, in the activation dtype (a = dtype
    bytes, at least 2 since fp8/int8 weights compute in 16-bit):
      T × (2·hidden [residual + normed input] + (heads + 2·kv_heads)·head_dim [q, k, v]
           + 2·intermediate [gate and up of SwiGLU]) × a
    plus the fp32 logits of the rows sampled, L = min(T, ``max_num_seqs``): L × vocab × 4.
    """
    t, a = max_num_batched_tokens, max(2, DTYPE_BYTES[canonical_dtype(dtype)])
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    per_token = 2 * shape.hidden_size + qkv + 2 * shape.intermediate_size
    logits = min(t, max_num_seqs) * shape.vocab_size * 4
    return t * per_token * a + logits


@dataclass(frozen=True)
class CapacityPlan:
    model: str
    gpu: str
    num_gpus: int
    dtype: str
    context: int
    gpu_memory_utilization: float
    weights_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int
    usable_bytes: int
    kv_bytes: int
    kv_tokens: int
    max_concurrent_sequences: int
    decode_tokens_per_s_bound: float
    fits: bool
    reason: str | None
    decode_batch_size: int
    num_params: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _validate(
    num_gpus: int, context: int, gpu_memory_utilization: float, batch_size: int | None, shape: ModelShape
) -> None:
    if num_gpus < 1:
        raise CapacityError(f"num_gpus must be at least 1, got {num_gpus}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise CapacityError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if context < 1:
        raise CapacityError(f"context must be at least 1, got {context}")
    if context > shape.max_position_embeddings:
        raise CapacityError(
            f"context {context} exceeds the max_position_embeddings {shape.max_position_embeddings} of {shape.name!r}"
        )
    if batch_size is not None and batch_size < 1:
        raise CapacityError(f"batch_size must be at least 1, got {batch_size}")


def decode_tokens_per_s_bound(
    shape: ModelShape, gpu: GPUSpec, *, num_gpus: int, context: int, batch_size: int, dtype: str = "bfloat16"
) -> float:
    """Memory-bandwidth roofline of decode: batch × aggregate bandwidth ÷ bytes read per step.

    One decode step at batch B reads every weight once and the K/V of B sequences of
    ``context`` tokens: bytes = weights + B × context × kv_bytes_per_token; it yields B tokens.
    """
    step_bytes = weights_bytes(shape, dtype) + batch_size * context * kv_bytes_per_token(shape, dtype)
    return batch_size * gpu.bandwidth_bytes_per_s * num_gpus / step_bytes


def _fit(
    usable: int, weights: int, activations: int, per_token: int, context: int
) -> tuple[int, int, int, str | None]:
    """(kv_bytes, kv_tokens, max_concurrent_sequences, reason it does not fit or None)."""
    kv_bytes = usable - weights - activations
    if kv_bytes <= 0:
        why = f"weights {weights} bytes + activations {activations} bytes exceed the usable {usable} bytes"
        return 0, 0, 0, why
    kv_tokens = kv_bytes // per_token
    max_seqs = kv_tokens // context
    if max_seqs == 0:
        why = f"KV room for {kv_tokens} tokens is less than one sequence of context {context}"
        return kv_bytes, kv_tokens, 0, why
    return kv_bytes, kv_tokens, max_seqs, None


def plan_capacity(
    shape: ModelShape,
    gpu: GPUSpec,
    *,
    num_gpus: int = 1,
    context: int | None = None,
    dtype: str = "bfloat16",
    gpu_memory_utilization: float = 0.9,
    batch_size: int | None = None,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
) -> CapacityPlan:
    """What fits of ``shape`` on ``num_gpus`` × ``gpu`` (tensor parallel), and how fast decode can go.

    usable = memory × num_gpus × utilisation; activations are :func:`activation_bytes` on each
    GPU (tensor parallel replicates the hidden-size buffers; counting the whole peak per GPU is
    conservative); kv_bytes = usable − weights − activations; kv_tokens = kv_bytes // per-token
    KV; max_concurrent_sequences = kv_tokens // context (context defaults to the model's
    max_position_embeddings). The decode bound uses batch_size, by default
    max(1, max_concurrent_sequences); when nothing fits it is the bound as if it did.
    """
    # Invariant: usable = weights + activations + kv_bytes whenever fits; kv_tokens × per-token ≤ kv_bytes.
    dtype = canonical_dtype(dtype)
    ctx = shape.max_position_embeddings if context is None else context
    _validate(num_gpus, ctx, gpu_memory_utilization, batch_size, shape)
    for field, value in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs)):
        if value < 1:
            raise CapacityError(f"{field} must be at least 1, got {value}")
    usable = int(gpu.memory_bytes * num_gpus * gpu_memory_utilization)
    weights = weights_bytes(shape, dtype)
    per_token = kv_bytes_per_token(shape, dtype)
    activations = num_gpus * activation_bytes(
        shape, dtype, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
    )
    kv_bytes, kv_tokens, max_seqs, reason = _fit(usable, weights, activations, per_token, ctx)
    batch = batch_size if batch_size is not None else max(1, max_seqs)
    bound = decode_tokens_per_s_bound(
        shape, gpu, num_gpus=num_gpus, context=ctx, batch_size=batch, dtype=dtype
    )
    return CapacityPlan(
        model=shape.name,
        gpu=gpu.name,
        num_gpus=num_gpus,
        dtype=dtype,
        context=ctx,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=weights,
        kv_bytes_per_token=per_token,
        activation_bytes=activations,
        usable_bytes=usable,
        kv_bytes=kv_bytes,
        kv_tokens=kv_tokens,
        max_concurrent_sequences=max_seqs,
        decode_tokens_per_s_bound=bound,
        fits=reason is None,
        reason=reason,
        decode_batch_size=batch,
        num_params=shape.num_params,
    )
