"""How a pooling engine turns a prompt's hidden states into one embedding: the pooler's settings.

Where it sits: ``--runner pooling`` (vLLM's name; ``--task embed`` says the same) makes the
runner build one :class:`PoolerConfig` at load with :func:`resolve_pooler_config`, from the
checkpoint (a sentence-transformers folder's ``modules.json`` and ``1_Pooling/config.json``,
the model's ``config.json`` for matryoshka truncation) and then ``--override-pooler-config``
over it, as vLLM does. The runner's pooling forward (``engine/model/pooling.py``) reads it.
Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.sampling_params import RequestError

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # the poolers by name (engine/model/pooling.py: POOLERS)
# sentence-transformers' Pooling modes, in the order vLLM reads them
_ST_MODES = (
    ("pooling_mode_cls_token", "CLS"),
    ("pooling_mode_mean_tokens", "MEAN"),
    ("pooling_mode_lasttoken", "LAST"),
)


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"  # a decoder's default, as vLLM's for a causal LM served as an embedder
    normalize: bool = True
    matryoshka: bool = False  # whether ``dimensions`` may truncate the vector
    matryoshka_dimensions: tuple[int, ...] | None = None  # the only sizes allowed, where the model lists them

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """A request's ``dimensions``: a RequestError naming the field unless this model truncates to it."""
        if dimensions is None:
            return
        if not self.matryoshka:
            raise RequestError(
                "dimensions",
                "this model does not support matryoshka representation: it cannot truncate its embeddings "
                "(leave dimensions out)",
            )
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise RequestError(
                "dimensions",
                f"dimensions={dimensions} is not one this model was trained for: {list(self.matryoshka_dimensions)}",
            )
        if not 1 <= dimensions <= hidden_size:
            raise RequestError(
                "dimensions", f"dimensions must be between 1 and {hidden_size}, got {dimensions}"
            )


def pooler_for(config: EngineConfig, model_dir: Path) -> PoolerConfig | None:
    """The runner's pooler: None unless ``--runner pooling``."""
    if config.runner != "pooling":
        return None
    return resolve_pooler_config(model_dir, config.override_pooler_config)


def resolve_pooler_config(model_dir: Path, override: dict[str, Any] | None) -> PoolerConfig:
    """The checkpoint's pooler, with ``--override-pooler-config``'s keys over it (a ValueError naming a bad one)."""
    cfg = PoolerConfig()
    modules = _read_json(model_dir / "modules.json")
    if isinstance(modules, list):
        kinds = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        cfg = replace(cfg, normalize=any(k.endswith("Normalize") for k in kinds))
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
                st = _read_json(model_dir / str(m.get("path", "")) / "config.json") or {}
                mode = next((name for key, name in _ST_MODES if st.get(key)), None)
                if mode is not None:
                    cfg = replace(cfg, pooling_type=mode)
    hf = _read_json(model_dir / "config.json") or {}
    dims = hf.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        cfg = replace(cfg, matryoshka=True, matryoshka_dimensions=tuple(int(d) for d in dims))
    elif hf.get("is_matryoshka"):
        cfg = replace(cfg, matryoshka=True)
    return _override(cfg, override or {})


def _override(cfg: PoolerConfig, override: dict[str, Any]) -> PoolerConfig:
    for key, value in override.items():
        if key == "pooling_type":
            if str(value).upper() not in POOLING_TYPES:
                raise ValueError(
                    f"override_pooler_config.pooling_type must be one of {POOLING_TYPES}, got {value!r}"
                )
            cfg = replace(cfg, pooling_type=str(value).upper())
        elif key == "normalize":
            if not isinstance(value, bool):
                raise ValueError(f"override_pooler_config.normalize must be true or false, got {value!r}")
            cfg = replace(cfg, normalize=value)
        else:
            raise ValueError(
                f"override_pooler_config: unknown key {key!r} (this engine reads pooling_type and normalize)"
            )
    return cfg


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
