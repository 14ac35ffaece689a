"""Which rope scalings a Llama-family checkpoint may name, what each needs, and how far it stretches the context: torch-free.

Where it sits: ``config.py`` checks a checkpoint's ``rope_scaling`` (or ``rope_parameters``)
against :data:`ROPE_TYPES` and the fields each type needs, and ``ModelConfig.max_model_len`` asks
:func:`rope_context_len` how far a type stretches the context; ``rope.py`` computes each type's
frequencies (torch) under the same names. This half imports no torch, so neither does ``config.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # config.py imports this module: named for the type checker only
    from kvfleet.engine.model.config import ModelConfig


class RopeScaling(NamedTuple):
    required: tuple[str, ...]  # fields of rope_scaling that must be present
    context_len: Callable[[ModelConfig], int]  # the context served (vLLM's derivation)
    dynamic: bool = False  # frequencies depend on the sequence's length (rope.dynamic_inv_freq)


def scaling_of(config: ModelConfig) -> dict[str, Any]:
    return config.rope_scaling or {}


def _positions_only(config: ModelConfig) -> int:
    return config.max_position_embeddings


def _stretched(config: ModelConfig) -> int:
    return int(config.max_position_embeddings * float(scaling_of(config)["factor"]))


def yarn_factor(config: ModelConfig) -> float:
    factor = scaling_of(config).get("factor")
    old_len = scaling_of(config)["original_max_position_embeddings"]
    return float(factor) if factor is not None else config.max_position_embeddings / old_len


def _yarn_context_len(config: ModelConfig) -> int:
    return int(scaling_of(config)["original_max_position_embeddings"] * yarn_factor(config))


_ROPE_TYPES: dict[str, RopeScaling] = {
    "default": RopeScaling((), _positions_only),
    "linear": RopeScaling(("factor",), _stretched),
    "dynamic": RopeScaling(("factor",), _stretched, dynamic=True),
    "yarn": RopeScaling(("original_max_position_embeddings",), _yarn_context_len),
    "llama3": RopeScaling(
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), _positions_only
    ),
}
ROPE_TYPES: tuple[str, ...] = tuple(_ROPE_TYPES)


def rope_type(name: str) -> RopeScaling | None:
    return _ROPE_TYPES.get(name)


def rope_type_name(config: ModelConfig) -> str:
    return str(scaling_of(config).get("rope_type", "default"))


def rope_is_dynamic(config: ModelConfig) -> bool:
    return _ROPE_TYPES[rope_type_name(config)].dynamic


def rope_context_len(config: ModelConfig) -> int:
    """The longest context the checkpoint's rope serves: linear and dynamic stretch
    max_position_embeddings by factor, yarn stretches original_max_position_embeddings."""
    return _ROPE_TYPES[rope_type_name(config)].context_len(config)
