"""The loaders by name: which one reads a checkpoint is the quantization config's choice, not the runner's.

Where it sits: ``ModelRunner`` resolves one ``QuantizationConfig`` (``layers/linear/config.py``) and
calls :func:`load_for` with it; the config's ``loader`` names one of :data:`LOADERS`: ``float``
(``loader/hf_loader.py``: safetensors in the compute dtype, sharded per tensor-parallel rank), ``gguf``
(``loader/gguf_loader.py``: the linears in the file's blocks) or ``quantized`` (``loader/hf_quant.py``:
int8/fp8 linears, from a compressed-tensors checkpoint or quantised at load). Each hands every
linear to the config's ``layers/linear`` method, and each cuts a tensor-parallel rank's part.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvfleet.engine.layers.linear.config import QuantizationConfig
from kvfleet.engine.loader.gguf_loader import load_quantized_model
from kvfleet.engine.loader.hf_loader import load_model
from kvfleet.engine.loader.hf_quant import load_hf_with
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.model.llama import LlamaForCausalLM

if TYPE_CHECKING:  # engine/parallel loads weights through this package: named for the type checker only
    from kvfleet.engine.parallel.shard import RankShard


class LoadRequest(NamedTuple):
    """What a loader is asked for: the model as named (``model``) and resolved (``folder``), the
    quantization config, the compute dtype and device, and this rank's shard (None: the whole)."""

    quant: QuantizationConfig
    model: str
    folder: Path
    dtype: torch.dtype
    device: torch.device
    shard: RankShard | None


Loader = Callable[[LoadRequest], LlamaForCausalLM]


def _float(r: LoadRequest) -> LlamaForCausalLM:
    return load_model(r.folder, r.dtype, r.device, r.shard)


def _gguf(r: LoadRequest) -> LlamaForCausalLM:
    return load_quantized_model(r.model, r.folder, r.dtype, r.device, r.quant.gguf_file, r.shard)


def _quantized(r: LoadRequest) -> LlamaForCausalLM:
    return load_hf_with(r.quant, r.folder, r.dtype, r.device, r.shard)


LOADERS: dict[str, Loader] = {"float": _float, "gguf": _gguf, "quantized": _quantized}


def load_for(
    quant: QuantizationConfig,
    model: str,
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    shard: RankShard | None = None,
) -> LlamaForCausalLM:
    """The model ``model`` (resolved to ``folder``) loaded as ``quant`` says; ``shard``: this rank's
    slice under tensor parallelism (every loader cuts it, each linear's method its own weights)."""
    loader = LOADERS.get(quant.loader)
    if loader is None:
        raise ModelLoadError(f"no loader {quant.loader!r} for {quant.source}; loaders: {sorted(LOADERS)}")
    return loader(LoadRequest(quant, model, folder, dtype, device, shard))
