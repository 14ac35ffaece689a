"""RoPE inverse frequencies for each scaling type a Llama-family checkpoint may name, as transformers computes them.

Where it sits: the model's ``RotaryEmbedding`` (``llama.py``) takes its frequencies and cos/sin
scale from :func:`rope_frequencies` at load, and, for ``dynamic``, :func:`dynamic_inv_freq` per
step. Which types exist, the fields each requires and the context each serves are
``rope_scaling.py``'s (torch-free, read by ``config.py``).

Types are registered by name (``default``, ``linear``, ``dynamic``, ``yarn``, ``llama3``), each with
its frequencies at load. The float maths
mirrors ``transformers.modeling_rope_utils`` operation for operation (Python floats where
transformers uses them, float32 tensors where it does), so greedy tokens stay identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.rope_scaling import scaling_of, yarn_factor


class RopeFrequencies(NamedTuple):
    inv_freq: torch.Tensor  # (head_dim // 2,) float32
    attention_scaling: float  # multiplies cos and sin (yarn's mscale; 1.0 otherwise)


def _base_inv_freq(theta: Any, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _default(config: ModelConfig) -> RopeFrequencies:
    return RopeFrequencies(_base_inv_freq(config.rope_theta, config.head_dim), 1.0)


def _linear(config: ModelConfig) -> RopeFrequencies:
    return RopeFrequencies(_default(config).inv_freq / scaling_of(config)["factor"], 1.0)


def _llama3(config: ModelConfig) -> RopeFrequencies:
    # Invariant: wavelengths shorter than old_len/high_freq_factor keep their frequency, longer
    # than old_len/low_freq_factor are divided by factor, and those between blend smoothly.
    scaling = scaling_of(config)
    inv_freq = _default(config).inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return RopeFrequencies(torch.where(medium, smoothed, scaled), 1.0)


def _dynamic(config: ModelConfig) -> RopeFrequencies:
    """At load transformers evaluates the NTK formula at max_position_embeddings (Python floats)."""
    dim, length, factor = config.head_dim, config.max_position_embeddings, scaling_of(config)["factor"]
    base = config.rope_theta * ((factor * length / length) - (factor - 1)) ** (dim / (dim - 2))
    return RopeFrequencies(_base_inv_freq(base, dim), 1.0)


def dynamic_inv_freq(config: ModelConfig, seq_len: int) -> torch.Tensor:
    """NTK-aware frequencies for a sequence of ``seq_len`` tokens, past max_position_embeddings.

    transformers recomputes them in the forward whose largest position is ``seq_len - 1``,
    with a 0-d int64 length tensor: float32 tensor arithmetic, reproduced here as is.
    """
    dim, factor, limit = config.head_dim, scaling_of(config)["factor"], config.max_position_embeddings
    length = torch.maximum(torch.tensor(seq_len), torch.tensor(limit))
    base = config.rope_theta * ((factor * length / limit) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim)


def _yarn_attention_factor(scaling: dict[str, Any], factor: float) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _yarn_correction_range(scaling: dict[str, Any], dim: int, base: float) -> tuple[float, float]:
    """The dimensions between which yarn blends extrapolation (fast) into interpolation (slow)."""
    old_len = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(config: ModelConfig) -> RopeFrequencies:
    # Invariant: dimensions below the correction range keep their frequency (extrapolate),
    # those above are divided by factor (interpolate), a linear ramp blends those between.
    scaling, dim, base = scaling_of(config), config.head_dim, config.rope_theta
    factor = yarn_factor(config)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(scaling, dim, base)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return RopeFrequencies(inv_freq, _yarn_attention_factor(scaling, factor))


# Each type's frequencies at load, by the names rope_scaling.ROPE_TYPES lists.
_FREQUENCIES: dict[str, Callable[[ModelConfig], RopeFrequencies]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
}


def rope_frequencies(config: ModelConfig) -> RopeFrequencies:
    """The frequencies and cos/sin scale the model starts with (float32, on the CPU).

    On the CPU even inside a ``torch.device("meta")`` block (the loader's): meta tensors compute
    through torch._refs, whose first use imports torch._dynamo, over a second of engine start.
    """
    with torch.device("cpu"):
        return _FREQUENCIES[str(scaling_of(config).get("rope_type", "default"))](config)
