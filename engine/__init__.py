"""kvfleet.engine: the paged-KV continuous-batching engine.

``from kvfleet.engine import LLM, SamplingParams``. Importing this package stays light
(no torch): ``LLM`` and ``Engine`` load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfleet.engine.outputs import EngineStats
from kvfleet.engine.sampling_params import (
    RequestError,
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
)

if TYPE_CHECKING:
    from kvfleet.engine.engine import Engine
    from kvfleet.engine.llm import LLM

__all__ = [
    "LLM",
    "Engine",
    "EngineStats",
    "RequestError",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingParamsError",
]

_LAZY = {
    "LLM": "kvfleet.engine.llm",
    "Engine": "kvfleet.engine.engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvfleet.engine' has no attribute {name!r}")
