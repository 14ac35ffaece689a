"""kvfleet.engine: the paged-KV continuous-batching engine.

``from kvfleet.engine import LLM, SamplingParams``. Importing this package stays light
(no torch): ``LLM`` and ``Engine`` load on first use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# The engine's matmuls and kernels run on torch's OpenMP pool, one thread per core. numpy's
# OpenBLAS (numpy comes with the tokenizer and the GGUF loader) would keep a second pool on the
# same cores, whose threads spin for a while after any numpy matmul: on a 2-core AMD EPYC a
# 492-token prefill took 986 ms with it and 903 ms without, 32 decode rows 227 and 193 ms
# (bench/results/amd_avx2.txt). Set before numpy loads; a user's own setting wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from kvfleet.engine.outputs import EngineStats
from kvfleet.engine.sampling_params import (
    RequestError,
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
)

if TYPE_CHECKING:
    from kvfleet.engine.client.llm import LLM
    from kvfleet.engine.core.engine import Engine

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
    "LLM": "kvfleet.engine.client.llm",
    "Engine": "kvfleet.engine.core.engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvfleet.engine' has no attribute {name!r}")
