"""Load a Hugging Face checkpoint folder into the Llama-family model.

Where it sits: the runner's quantization config names this loader (``float``, ``loader/registry.py``)
for a float checkpoint, and calls :func:`load_model` with the folder (or the embedded ``tiny``
one), as each tensor-parallel worker does; the loader reads ``config.json``, finds the weights (``model.safetensors``,
or the shards that ``model.safetensors.index.json`` names), and copies each tensor into
the module of the same Hugging Face name. Whatever is missing, corrupt or the wrong
shape fails with :class:`ModelLoadError` naming the file and the tensor.

Tensor parallelism (``shard``, from ``engine/parallel/shard.py``): the model is built at the
rank's sizes and each split tensor is read through ``safe_open(...).get_slice``, so a rank reads
and holds only its own rows or columns (``tp.checkpoint_slice`` says which).

A tensor stored MXFP4-packed (``<name>_blocks`` + ``<name>_scales``: gpt-oss's experts) is read
dequantized to the model dtype (``loader/mxfp4.py``), then sliced as its float form would be.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from kvfleet.engine.loader import mxfp4
from kvfleet.engine.model.config import ModelConfig, ModelLoadError
from kvfleet.engine.model.llama import LlamaForCausalLM
from kvfleet.engine.model.tp import SliceSpec, slice_for

if TYPE_CHECKING:  # engine/parallel loads weights through this package: named for the type checker only
    from kvfleet.engine.parallel.shard import RankShard
from kvfleet.engine.model.registry import model_class, resolve_architecture

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_config(folder: Path) -> ModelConfig:
    _check_folder(folder)
    return ModelConfig.from_file(folder / "config.json")


def build_model(config: ModelConfig, shard: RankShard | None = None) -> LlamaForCausalLM:
    """The model class the config's family registered (``registry.py``), built at this rank's sizes."""
    spec = resolve_architecture([config.architecture])
    if spec is None:  # a ModelConfig is only made for a registered architecture
        raise ModelLoadError(f"architecture {config.architecture} is not registered")
    model: LlamaForCausalLM = model_class(spec)(config, shard)
    return model


def load_model(
    folder: Path, dtype: torch.dtype, device: torch.device, shard: RankShard | None = None
) -> LlamaForCausalLM:
    config = load_config(folder)
    with torch.device("meta"):
        model = build_model(config, shard)
    _materialise(model, dtype, device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # A non-persistent buffer, made on the CPU in float32: moved to the device, float32 whatever the dtype.
    model.reset_buffers(device)
    _copy_weights(model, weight_files(folder), shard)
    model.pack()
    return model.eval()


def _materialise(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter uninitialised storage of ``dtype`` on ``device``, to be loaded into.

    Not ``to_empty``: its ``empty_like`` of meta tensors runs through torch._refs, which imports
    sympy and torch's symbolic shapes, most of a second at every engine start.
    """
    # a parameter shared by two modules (tied embeddings) stays shared
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                storage = torch.empty(param.shape, dtype=dtype, device=device)
                made[id(param)] = torch.nn.Parameter(storage, requires_grad=False)
            setattr(module, name, made[id(param)])


def _check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: model folder does not exist (expected config.json, *.safetensors)")


def weight_files(folder: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it (from the index, or the one file)."""
    index = folder / INDEX_FILE
    if index.is_file():
        return _files_from_index(index)
    single = folder / SINGLE_FILE
    if single.is_file():
        return {name: single for name in _tensor_names(single)}
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if len(found) == 1:
        path = folder / found[0]
        return {name: path for name in _tensor_names(path)}
    bins = sorted(p.name for p in folder.glob("*.bin"))
    hint = f"; found only {bins} (PyTorch pickles are not loaded: convert to safetensors)" if bins else ""
    raise ModelLoadError(f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE}{hint}")


def _files_from_index(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
    files: dict[str, Path] = {}
    for name, shard in weight_map.items():
        path = index.parent / shard
        if not path.is_file():
            raise ModelLoadError(f"{path}: shard named by {index.name} for {name!r} is missing")
        files[name] = path
    return files


def _tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from e


def _slices(model: LlamaForCausalLM, names: list[str], shard: RankShard | None) -> dict[str, SliceSpec]:
    if shard is None:
        return {}
    found = {name: slice_for(name, shard, model.config) for name in names}
    return {name: spec for name, spec in found.items() if spec is not None}


def _copy_weights(model: LlamaForCausalLM, files: dict[str, Path], shard: RankShard | None = None) -> None:
    # Invariant: every parameter of the model is written exactly once from a tensor of its shape.
    params = dict(model.named_parameters(remove_duplicate=False))
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight")
    packed = mxfp4.packed_tensors(files)
    files = {**files, **{name: files[pair[0]] for name, pair in packed.items() if name in params}}
    missing = sorted(set(params) - set(files))
    if missing:
        where = sorted({str(p) for p in files.values()})
        raise ModelLoadError(f"{where}: weights missing for {missing[:5]} ({len(missing)} in all)")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(files[name], []).append(name)
    slices = _slices(model, list(params), shard)
    for path, names in by_file.items():
        _copy_from_file(path, names, params, slices, packed)


def _read(f: object, path: Path, name: str, spec: SliceSpec | None) -> torch.Tensor:
    """The tensor ``name``, or only the slice ``spec`` of it (its whole axis checked first)."""
    if spec is None:
        return f.get_tensor(name)  # type: ignore[attr-defined,no-any-return]
    sliced = f.get_slice(name)  # type: ignore[attr-defined]
    shape = tuple(sliced.get_shape())
    if len(shape) <= spec.dim or shape[spec.dim] != spec.full:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has shape {shape}, the config needs {spec.full} along axis {spec.dim}"
        )
    tensor: torch.Tensor = sliced[(slice(None),) * spec.dim + (spec.span,)]
    return tensor


def _read_packed(
    path: Path, f: object, name: str, pair: tuple[str, str], spec: SliceSpec | None, dtype: torch.dtype
) -> torch.Tensor:
    """An MXFP4-packed tensor, dequantized whole, then ``spec``'s slice of it (its axis checked first)."""
    try:
        tensor = mxfp4.read_packed(f, pair, dtype)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {name!r}: {e}") from e
    if spec is None:
        return tensor
    if tensor.dim() <= spec.dim or tensor.shape[spec.dim] != spec.full:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, the config needs {spec.full} along axis {spec.dim}"
        )
    return tensor[(slice(None),) * spec.dim + (spec.span,)]


def _copy_from_file(
    path: Path,
    names: list[str],
    params: dict[str, torch.nn.Parameter],
    slices: dict[str, SliceSpec] | None = None,
    packed: dict[str, tuple[str, str]] | None = None,
) -> None:
    slices, packed = slices or {}, packed or {}
    try:
        with safe_open(str(path), framework="pt") as f, torch.no_grad():
            for name in names:
                param = params[name]
                if name in packed:
                    tensor = _read_packed(path, f, name, packed[name], slices.get(name), param.dtype)
                else:
                    tensor = _read(f, path, name, slices.get(name))
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"the config needs {tuple(param.shape)}"
                    )
                param.copy_(tensor)
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from e
