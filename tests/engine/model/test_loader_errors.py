"""Folders that cannot be served fail with a ModelLoadError naming the file and what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.loader.hf_loader import load_model, weight_files
from kvfleet.engine.model.config import ModelLoadError
from kvfleet.engine.model.registry import known_architectures
from kvfleet.engine.runner.model_runner import build_runner

CPU = torch.device("cpu")


def copy_of(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(folder, dest)
    return dest


def test_an_unknown_architecture_is_named_with_the_known_ones(tiny_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as e:
        load_model(folder, torch.float32, CPU)
    known = known_architectures()  # every registered family (engine/model/families/), sorted
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"} <= set(known)
    assert str(e.value) == (
        f"{folder / 'config.json'}: architecture GPTNeoXForCausalLM is not supported; known architectures: {known}"
    )


def test_a_folder_without_safetensors_says_which_files_it_found(tiny_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_dir, tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors and no model\.safetensors\.index\.json"):
        load_model(folder, torch.float32, CPU)
    with pytest.raises(ModelLoadError, match=r"found only \['pytorch_model\.bin'\]"):
        load_model(folder, torch.float32, CPU)


def test_a_corrupt_safetensors_file_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_dir, tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(folder, torch.float32, CPU)


def test_a_truncated_safetensors_file_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_dir, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(folder, torch.float32, CPU)


def test_a_shard_missing_from_a_sharded_checkpoint_is_named(
    hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    folder = copy_of(hf_checkpoints["llama-gqa-llama3-sharded"], tmp_path)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and len(set(weight_files(folder).values())) == len(shards)
    shards[-1].unlink()
    with pytest.raises(
        ModelLoadError, match=rf"{shards[-1].name}: shard named by model\.safetensors\.index\.json"
    ):
        load_model(folder, torch.float32, CPU)


def test_a_missing_tokenizer_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_dir, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: tokenizer\.json is missing"):
        build_runner(EngineConfig(model=str(folder), num_kv_blocks=4))


def test_a_missing_folder_and_a_missing_config_are_named(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model folder does not exist"):
        build_runner(EngineConfig(model=str(tmp_path / "nowhere")))
    folder = copy_of(tiny_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: config\.json is missing"):
        load_model(folder, torch.float32, CPU)


def test_a_weight_of_the_wrong_shape_names_the_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(tiny_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 256
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(384, 128\)"
    ):
        load_model(folder, torch.float32, CPU)


def test_a_max_model_len_beyond_the_model_names_both(tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="max_model_len=4096 exceeds the model's limit of 2048"):
        build_runner(EngineConfig(model=str(tiny_dir), max_model_len=4096, num_kv_blocks=4))
