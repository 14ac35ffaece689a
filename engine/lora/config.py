"""A LoRA adapter's identity and its ``adapter_config.json``, checked before any weight is read.

Where it sits: the first box of the LoRA path (docs/engine/parallel-and-lora.md). ``kvfleet engine
--lora-modules name=path``, ``LLM(lora_modules=...)`` and ``POST /v1/load_lora_adapter`` name
an adapter folder in PEFT's format; :func:`read_adapter_config` reads its config and refuses
what the engine cannot serve, naming the field. Torch-free: the API process and the engine
loop import it; the weights are read by :mod:`kvfleet.engine.lora.weights` in the runner.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.engine.sampling_params import RequestError

log = logging.getLogger(__name__)

# The projections an adapter may target, in the order the model runs them.
# Each projection an adapter may target, and the axes it reads and writes: "hidden", "q" (query heads
# × head_dim), "kv" (KV heads × head_dim), "inter" (the MLP's intermediate size). The adapters'
# shapes (lora/weights.py) and each tensor-parallel rank's share of them (parallel/shard.py) read it.
PROJECTION_AXES: dict[str, tuple[str, str]] = {
    "q_proj": ("hidden", "q"),
    "k_proj": ("hidden", "kv"),
    "v_proj": ("hidden", "kv"),
    "o_proj": ("q", "hidden"),
    "gate_proj": ("hidden", "inter"),
    "up_proj": ("hidden", "inter"),
    "down_proj": ("inter", "hidden"),
}
TARGET_MODULES = tuple(PROJECTION_AXES)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoraError(RequestError):
    """An adapter operation the engine refuses; ``status`` is the HTTP status the server answers with."""

    def __init__(
        self, field_name: str | None, reason: str, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(field_name, reason)
        self.status = status
        self.code = code


def unknown_adapter(name: str, field_name: str = "lora_name") -> LoraError:
    return LoraError(field_name, f"no LoRA adapter named {name!r} is loaded", 404, "model_not_found")


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine uses of a PEFT ``adapter_config.json``."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # among TARGET_MODULES, in their order
    base_model: str | None  # base_model_name_or_path, as written

    @property
    def scaling(self) -> float:
        """PEFT's: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def parse_lora_modules(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["name=path", ...]`` (the ``--lora-modules`` flag) as {name: path}; a malformed item is a ValueError."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules: {item!r} is not name=path")
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out[name.strip()] = path.strip()
    return out


def read_adapter_config(path: str | Path, max_rank: int, served_model: str | None = None) -> AdapterConfig:
    """The adapter folder's config, or a :class:`LoraError` naming what is wrong (field ``lora_path``)."""
    folder = Path(path)
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoraError("lora_path", f"{str(folder)!r} is not a folder")
    if not (folder / WEIGHTS_FILE).is_file():
        raise LoraError("lora_path", f"{str(folder)!r} has no {WEIGHTS_FILE}")
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoraError("lora_path", f"{str(folder)!r} has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError("lora_path", f"{file} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LoraError("lora_path", f"{file} is not a JSON object")
    return _checked(raw, file, max_rank, served_model)


def _checked(raw: dict[str, Any], file: Path, max_rank: int, served_model: str | None) -> AdapterConfig:
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError("lora_path", f"{file}: peft_type is {peft_type!r}; only LORA adapters are served")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if raw.get(key):
            raise LoraError("lora_path", f"{file}: {key} is set ({raw[key]!r}); the engine serves plain LoRA")
    if raw.get("bias", "none") != "none":
        raise LoraError(
            "lora_path", f"{file}: bias={raw['bias']!r}; the engine serves adapters without biases"
        )
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraError("lora_path", f"{file}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(
            "lora_path", f"{file}: the adapter's rank r={rank} is above --max-lora-rank={max_rank}"
        )
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoraError("lora_path", f"{file}: lora_alpha must be a number, got {alpha!r}")
    targets = _target_modules(raw.get("target_modules"), file)
    base = raw.get("base_model_name_or_path")
    _check_base(base if isinstance(base, str) else None, served_model, file)
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora", False)), targets, base)


def _target_modules(value: Any, file: Path) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise LoraError("lora_path", f"{file}: target_modules must be a non-empty list of projection names")
    names = {str(v).rsplit(".", 1)[-1] for v in value}
    unknown = sorted(names - set(TARGET_MODULES))
    if unknown:
        raise LoraError(
            "lora_path",
            f"{file}: target_modules {unknown} are not projections of this model (it has {list(TARGET_MODULES)})",
        )
    return tuple(m for m in TARGET_MODULES if m in names)


def _check_base(base: str | None, served_model: str | None, file: Path) -> None:
    """Warn, never refuse: a base path is a name on the training machine, not an identity here.

    The weights' shapes are the real check (:mod:`kvfleet.engine.lora.weights` refuses an adapter
    whose matrices do not fit this model); a base name that differs from the served one is often
    the same model under another path, so it is logged for the operator to see.
    """
    if base is None or served_model is None:
        return
    if Path(base).name.lower() != Path(served_model).name.lower():
        log.warning(
            "%s: base_model_name_or_path is %r, the engine serves %r; loading it since its shapes fit",
            file,
            base,
            served_model,
        )
