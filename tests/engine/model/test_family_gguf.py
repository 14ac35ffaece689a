"""GGUF files of the registered families beyond Llama (llama.cpp's ``qwen3`` and ``gemma3``): converted back to
the Hugging Face checkpoint they were written from, and served quantised (in their blocks) within a
stated tolerance of their dequantised weights in a plain folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import Gemma3TextConfig, Qwen3Config

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.loader.gguf_convert import gguf_folder
from kvfleet.engine.testing.tiny_gguf import write_gguf

from .conftest import COMMON, GEMMA_NORMS, save_checkpoint
from .test_runner_hf_equivalence import prefill_logits

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, *range(40, 69)], [256, 1, 2, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 (q/k norms made to count, head_dim 32 over hidden 64 / 4 heads) as transformers writes it."""
    folder = tmp_path_factory.mktemp("qwen3")
    config = Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return save_checkpoint(config, folder, "qwen3", (("norm.weight", 1.0, 0.3),))


def _gguf(folder: Path, path: Path, qtype: gguf.GGMLQuantizationType, arch: str = "qwen3") -> Path:
    config = json.loads((folder / "config.json").read_text())
    more = {f"{arch}.attention.sliding_window": config["sliding_window"]} if arch == "gemma3" else None
    weights = load_file(str(folder / "model.safetensors"))
    return write_gguf(path, weights, arch=arch, qtype=qtype, config=config, more=more)


def test_an_f32_qwen3_gguf_converts_back_to_its_checkpoint_with_q_k_norms_and_unpermuted_rows(
    qwen3_folder: Path, tmp_path: Path, cache: Path
) -> None:
    original = load_file(str(qwen3_folder / "model.safetensors"))
    folder = gguf_folder(_gguf(qwen3_folder, tmp_path / "q.gguf", gguf.GGMLQuantizationType.F32))
    converted = load_file(str(folder / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    assert "model.layers.1.self_attn.k_norm.weight" in converted
    for name, array in original.items():
        np.testing.assert_array_equal(converted[name], array, err_msg=name)
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["head_dim"]) == (["Qwen3ForCausalLM"], 32)


def _prefill_logits(model: Path, folder: Path) -> tuple[torch.Tensor, str]:
    return prefill_logits(model, folder, PROMPTS, num_kv_blocks=128)  # Gemma 3: a table per KV cache group


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_quantised_gguf_served_in_its_blocks_is_within_the_stated_tolerance_of_its_dequantised_weights(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path, cache: Path
) -> None:
    """The quantised kernel rounds the activations to int8 per 32 (llama.cpp's Q8_0 activations), so
    the logits are not the dequantised float model's bit for bit: within 5% of their largest magnitude
    (measured: 0.18 of 5.1 on the Qwen3), and the same greedy token at every prompt."""
    folder = request.getfixturevalue(f"{arch}_folder")
    qtype = gguf.GGMLQuantizationType.Q8_0
    path = _gguf(folder, tmp_path / f"{arch}-Q8_0.gguf", qtype, arch)
    reference = tmp_path / "reference"
    shutil.copytree(folder, reference)
    original = load_file(str(folder / "model.safetensors"))
    dequantised = {
        k: gguf.quants.dequantize(gguf.quants.quantize(v, qtype), qtype) if v.ndim == 2 else v
        for k, v in original.items()
    }
    save_file(dequantised, str(reference / "model.safetensors"))
    served, loader = _prefill_logits(path, gguf_folder(path))
    expected, _ = _prefill_logits(reference, reference)
    assert loader == "gguf", "served in its blocks, not dequantised"
    torch.testing.assert_close(served, expected, atol=0.05 * float(expected.abs().max()), rtol=0)
    assert served.argmax(-1).tolist() == expected.argmax(-1).tolist()
    (out,) = LLM(model=str(path), num_kv_blocks=32).generate(PROMPTS[:1], GREEDY)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 of 6 layers (llama.cpp's fixed pattern: 5 sliding, then a global one), window 6."""
    folder = tmp_path_factory.mktemp("gemma3")
    shape = {**COMMON, "num_hidden_layers": 6}
    config = Gemma3TextConfig(
        **shape, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=6
    )
    config.query_pre_attn_scalar = 32  # llama.cpp scales by 1/sqrt(head_dim)
    return save_checkpoint(config, folder, "gemma3", (GEMMA_NORMS,))


def test_an_f32_gemma3_gguf_converts_back_to_its_checkpoint_and_serves_transformers_tokens(
    gemma3_folder: Path, tmp_path: Path, cache: Path, hf_greedy: Any
) -> None:
    config = json.loads((gemma3_folder / "config.json").read_text())
    assert config["layer_types"][-2:] == ["sliding_attention", "full_attention"]
    original = load_file(str(gemma3_folder / "model.safetensors"))
    path = write_gguf(
        tmp_path / "g.gguf",
        original,
        arch="gemma3",
        config=config,
        more={"gemma3.attention.sliding_window": 6},
    )
    folder = gguf_folder(path)
    converted = load_file(str(folder / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    for name, array in original.items():  # the norms' 1 + w taken back to w
        np.testing.assert_allclose(converted[name], array, rtol=0, atol=1e-6, err_msg=name)
    (out,) = LLM(model=str(path), num_kv_blocks=32, attention_backend="torch").generate([PROMPTS[1]], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy(gemma3_folder, PROMPTS[1], GREEDY.max_tokens)
