"""The architecture registry: the model families the engine serves, one :class:`ArchitectureSpec` each.

Where it sits: ``ModelConfig.from_dict`` (``config.py``) resolves a ``config.json``'s
``architectures`` here and the GGUF converter (``loader/gguf_convert.py``) a file's
``general.architecture``; the loaders then build the spec's model class. A name known to neither
is refused at start, naming it and listing the known ones. Each family is one small module under
``engine/model/families/`` that calls :func:`register_architecture` at import; ``families/__init__``
imports them all, on the first look-up here.

Torch-free (the API process converts GGUF files through here): a spec names its model class as
``"module:Class"``, imported only when a model is built (:func:`model_class`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SHARED_DECODER = "kvfleet.engine.model.llama:LlamaForCausalLM"
# (raw config.json, its layer count) -> the family's own ModelConfig fields (qkv_bias, layer_windows ...).
ConfigFields = Callable[[Mapping[str, Any], int], dict[str, Any]]
# (the GGUF file's fields, its architecture name) -> config.json fields beyond the shared ones.
GGUFFields = Callable[[Mapping[str, Any], str], dict[str, Any]]


def _none(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    return {}


def _no_gguf_fields(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ArchitectureSpec:
    """One family: its Hugging Face ``architectures`` name and its GGUF ``general.architecture``.

    ``config``: the family's ModelConfig fields from ``config.json``. ``model``: the class built from
    a ModelConfig and a shard (``"module:Class"``; the shared Llama-family decoder by default).
    GGUF: ``gguf_layer_tensors`` maps the family's per-layer GGUF tensor names (``attn_q_norm.weight``)
    to Hugging Face ones beyond the shared Llama set, ``gguf_required`` those a file must hold,
    ``gguf_permuted_qk`` says llama.cpp permuted its q/k rows, ``gguf_config`` adds config.json fields,
    ``gguf_norm_shift`` is what llama.cpp added to every ``*norm.weight``."""

    name: str
    gguf_name: str | None = None
    config: ConfigFields = _none
    model: str = SHARED_DECODER
    gguf_layer_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_required: tuple[str, ...] = ()
    gguf_permuted_qk: bool = False
    gguf_config: GGUFFields = _no_gguf_fields
    gguf_norm_shift: float = 0.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w: subtracted back
    gguf_dense_mlp: bool = True  # the file must hold ffn_gate/ffn_up/ffn_down per layer (an MoE's: False)


_BY_NAME: dict[str, ArchitectureSpec] = {}
_BY_GGUF: dict[str, ArchitectureSpec] = {}
_loaded = False


def register_architecture(spec: ArchitectureSpec) -> ArchitectureSpec:
    """Make ``spec`` known by its ``name`` (and ``gguf_name``); a second family of either name is an error."""
    if spec.name in _BY_NAME:
        raise ValueError(f"architecture {spec.name!r} is registered twice")
    if spec.gguf_name is not None and spec.gguf_name in _BY_GGUF:
        raise ValueError(f"GGUF architecture {spec.gguf_name!r} is registered twice")
    _BY_NAME[spec.name] = spec
    if spec.gguf_name is not None:
        _BY_GGUF[spec.gguf_name] = spec
    return spec


def _families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        importlib.import_module("kvfleet.engine.model.families")


def resolve_architecture(names: list[str] | tuple[str, ...]) -> ArchitectureSpec | None:
    """The first of a config.json's ``architectures`` that is registered (None: none is)."""
    _families()
    return next((_BY_NAME[n] for n in names if n in _BY_NAME), None)


def gguf_architecture(name: str) -> ArchitectureSpec | None:
    """The family of a GGUF ``general.architecture`` (None: not registered)."""
    _families()
    return _BY_GGUF.get(name)


def known_architectures() -> list[str]:
    _families()
    return sorted(_BY_NAME)


def known_gguf_architectures() -> list[str]:
    _families()
    return sorted(_BY_GGUF)


def model_class(spec: ArchitectureSpec) -> Any:
    """The class ``spec.model`` names (imported now: this is where torch comes in)."""
    module, _, name = spec.model.partition(":")
    return getattr(importlib.import_module(module), name)
