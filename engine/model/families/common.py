"""Config parsing the families share: sliding windows per layer, as transformers reads them.

Where it sits: each family module (``families/*.py``) builds its ``config`` hook of the
architecture registry (``engine/model/registry.py``) from these; torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Windows = tuple[int | None, ...]


def window_size(raw: Mapping[str, Any]) -> int | None:
    """``sliding_window`` checked: a positive number of tokens, or None."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} must be a positive integer (tokens) or null")
    return window


def no_windows(num_layers: int) -> Windows:
    return (None,) * num_layers


def every_layer(raw: Mapping[str, Any], num_layers: int) -> Windows:
    """Mistral's: ``sliding_window`` (when set) on every layer."""
    return (window_size(raw),) * num_layers


def from_layer_types(raw: Mapping[str, Any], num_layers: int, first_sliding: int) -> Windows:
    """``sliding_window`` on the layers ``layer_types`` marks ``sliding_attention``; without
    ``layer_types``, on the layers from ``first_sliding`` on."""
    window = window_size(raw)
    if window is None:
        return no_windows(num_layers)
    types = raw.get("layer_types")
    if types is None:
        return tuple(window if i >= first_sliding else None for i in range(num_layers))
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers={num_layers}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def qwen_windows(raw: Mapping[str, Any], num_layers: int) -> Windows:
    """Qwen2's and Qwen3's: windows only with ``use_sliding_window``, on the layers ``layer_types``
    marks (when absent: layers from ``max_window_layers`` on, transformers' default 28)."""
    if not raw.get("use_sliding_window", False):
        return no_windows(num_layers)
    return from_layer_types(raw, num_layers, int(raw.get("max_window_layers", 28)))
