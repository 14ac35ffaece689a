"""The pooling forward against transformers: each prompt's pooled final hidden state, float32, within 1e-5.

The reference runs every prompt alone and unpadded through transformers with
``output_hidden_states=True`` and pools its last hidden states (the final norm's output) by hand;
kvfleet runs all the prompts in one flat batch with no KV cache (engine/model/pooling.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.model.pooler_config import PoolerConfig
from kvfleet.engine.model.pooling import pool
from kvfleet.engine.runner.model_runner import ModelRunner

from .conftest import PROMPTS, load_hf, make_checkpoint

# GQA with llama3 rope, a 7-key sliding window on every layer, a window on one layer with q/k/v biases
POOLING_VARIANTS = ("llama-gqa-llama3-sharded", "mistral-window", "qwen2-window")
PROMPTS_MORE = [*PROMPTS, [256, 7], [256] + list(range(100, 160))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool")
    return {v: make_checkpoint(v, root / v) for v in POOLING_VARIANTS}


def _runner(folder: Path) -> ModelRunner:
    return ModelRunner(
        EngineConfig(model=str(folder), runner="pooling", attention_backend="torch", block_size=4), folder
    )


def _reference(hf: Any, prompt: list[int], pooling: str, normalize: bool, dims: int | None) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling].float()
    vec = vec if dims is None else vec[:dims]
    return F.normalize(vec, dim=-1) if normalize else vec


@pytest.mark.parametrize("variant", POOLING_VARIANTS)
@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_pooled_embeddings_equal_transformers_hidden_states(
    checkpoints: dict[str, Path], variant: str, pooling: str
) -> None:
    runner, hf = _runner(checkpoints[variant]), load_hf(checkpoints[variant])
    for normalize in (False, True):
        got = pool(runner.model, PROMPTS_MORE, PoolerConfig(pooling, normalize))
        assert got.dtype == torch.float32 and got.shape == (len(PROMPTS_MORE), 64)
        for i, prompt in enumerate(PROMPTS_MORE):
            torch.testing.assert_close(
                got[i], _reference(hf, prompt, pooling, normalize, None), rtol=1e-5, atol=1e-5
            )


def test_dimensions_truncate_before_normalising(checkpoints: dict[str, Path]) -> None:
    folder = checkpoints["llama-gqa-llama3-sharded"]
    runner, hf = _runner(folder), load_hf(folder)
    got = pool(runner.model, PROMPTS_MORE, PoolerConfig("LAST", True, matryoshka=True), dimensions=16)
    assert got.shape == (len(PROMPTS_MORE), 16)
    for i, prompt in enumerate(PROMPTS_MORE):
        torch.testing.assert_close(got[i], _reference(hf, prompt, "LAST", True, 16), rtol=1e-5, atol=1e-5)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(PROMPTS_MORE)))


def test_a_pooling_runner_holds_one_kv_block(checkpoints: dict[str, Path]) -> None:
    assert _runner(checkpoints["qwen2-window"]).num_kv_blocks == 1


def test_the_offline_llm_embeds_as_the_server_does_and_refuses_by_field(checkpoints: dict[str, Path]) -> None:
    from kvfleet.engine.client.llm import LLM
    from kvfleet.engine.sampling_params import RequestError

    folder = checkpoints["mistral-window"]
    llm = LLM(str(folder), runner="pooling", attention_backend="torch")
    got = llm.embed(PROMPTS_MORE)
    hf = load_hf(folder)
    for vec, prompt in zip(got, PROMPTS_MORE, strict=True):
        torch.testing.assert_close(
            torch.tensor(vec), _reference(hf, prompt, "LAST", True, None), rtol=1e-5, atol=1e-5
        )
    with pytest.raises(RequestError) as vocab:
        llm.embed([[256, 9999]])
    assert vocab.value.field == "input"
    with pytest.raises(RequestError) as dims:
        llm.embed(PROMPTS_MORE, dimensions=8)  # not a matryoshka model
    assert dims.value.field == "dimensions"
    with pytest.raises(RequestError) as generating:
        LLM(str(folder), attention_backend="torch", num_kv_blocks=8).embed(PROMPTS_MORE)
    assert generating.value.field == "model"
