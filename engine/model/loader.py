"""Load a Hugging Face checkpoint folder into the Llama-family model.

Where it sits: ``build_runner`` calls :func:`load_model` with the folder (or the embedded
``tiny`` one); the loader reads ``config.json``, finds the weights (``model.safetensors``,
or the shards that ``model.safetensors.index.json`` names), and copies each tensor into
the module of the same Hugging Face name. Whatever is missing, corrupt or the wrong
shape fails with :class:`ModelLoadError` naming the file and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvfleet.engine.model.config import ModelConfig, ModelLoadError
from kvfleet.engine.model.llama import LlamaForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_config(folder: Path) -> ModelConfig:
    _check_folder(folder)
    return ModelConfig.from_file(folder / "config.json")


def load_model(folder: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    config = load_config(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    _materialise(model, dtype, device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # A non-persistent buffer, made on the CPU in float32: moved to the device, float32 whatever the dtype.
    model.model.rotary_emb.reset_buffers(device)
    _copy_weights(model, weight_files(folder))
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


def _copy_weights(model: LlamaForCausalLM, files: dict[str, Path]) -> None:
    # Invariant: every parameter of the model is written exactly once from a tensor of its shape.
    params = dict(model.named_parameters(remove_duplicate=False))
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight")
    missing = sorted(set(params) - set(files))
    if missing:
        where = sorted({str(p) for p in files.values()})
        raise ModelLoadError(f"{where}: weights missing for {missing[:5]} ({len(missing)} in all)")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        _copy_from_file(path, names, params)


def _copy_from_file(path: Path, names: list[str], params: dict[str, torch.nn.Parameter]) -> None:
    try:
        with safe_open(str(path), framework="pt") as f, torch.no_grad():
            for name in names:
                tensor = f.get_tensor(name)
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(
                        f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"the config needs {tuple(param.shape)}"
                    )
                param.copy_(tensor)
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from e
