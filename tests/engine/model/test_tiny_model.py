"""The embedded tiny model: the same bytes from every build, a real Hugging Face folder, built once."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.runner.model_runner import build_runner
from kvfleet.engine.testing.tiny import build_tiny_model, ensure_tiny_model

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_two_builds_write_byte_identical_folders(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    build_tiny_model(tmp_path / "a")
    build_tiny_model(tmp_path / "b")
    assert sorted(digests(tmp_path / "a")) == FILES
    assert digests(tmp_path / "a") == digests(tmp_path / "b")


def test_transformers_loads_the_tiny_folder_as_a_llama(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 853_888


def test_model_tiny_is_built_once_into_the_kvfleet_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path))
    folder = ensure_tiny_model()
    assert folder == tmp_path / "tiny-v1"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    _, tokenizer, info = build_runner(EngineConfig(model="tiny", num_kv_blocks=8))
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    # no staging folder left behind (beside it: "kernels", the native ops' build cache, made on first use)
    assert [p.name for p in tmp_path.iterdir() if p.name != "kernels"] == ["tiny-v1"]
    assert (info.name, info.max_model_len, info.eos_token_ids, info.vocab_size, info.has_chat_template) == (
        "tiny",
        2048,
        frozenset({257}),
        259,
        True,
    )
    assert tokenizer.encode("hi") == [256, 104, 105]
