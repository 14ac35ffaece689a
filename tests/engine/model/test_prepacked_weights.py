"""The runner keeps each layer's linears packed for MKL, and the model's output does not move.

``EngineConfig.prepack_weights`` (default on): after loading, every layer holds an MKL-packed
copy of its q/k/v, o_proj, gate/up and down_proj weights, which steps of more than 16 rows
read (kernels/mkl_packed.py). The logits of a 40-row prefill equal those with it off up to
float32 summation order, biases (qwen2) included; the greedy-token tests against
transformers run with it on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels import mkl_packed
from kvfleet.engine.runner import ModelRunner

needs_mkl = pytest.mark.skipif(not mkl_packed.available(), reason="this torch build has no MKL pack API")
ROWS = 40


def make_runner(folder: Path, **overrides: bool) -> ModelRunner:
    config = EngineConfig(
        model=str(folder), num_kv_blocks=16, block_size=16, attention_backend="torch", **overrides
    )
    return ModelRunner(config, folder)


def packs(runner: ModelRunner) -> list[object]:
    return [
        p
        for layer in runner.model.model.layers
        for p in (layer.self_attn.mkl_qkv, layer.self_attn.mkl_o, layer.mlp.mkl_gate_up, layer.mlp.mkl_down)
    ]


def prefill_logits(runner: ModelRunner) -> torch.Tensor:
    meta = AttentionMetadata(
        slot_mapping=torch.arange(ROWS),
        block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32),
        seq_lens=torch.tensor([ROWS], dtype=torch.int32),
        query_start_loc=torch.tensor([0, ROWS], dtype=torch.int32),
        max_query_len=ROWS,
        max_seq_len=ROWS,
    )
    ids = torch.arange(ROWS) * 7 % 200 + 3
    with torch.inference_mode():
        return runner.model(
            ids, torch.arange(ROWS), runner.kv_caches, meta, runner.backend, torch.tensor([ROWS - 1])
        )


@needs_mkl
@pytest.mark.parametrize("variant", ["tiny", "qwen2-tied"])
def test_every_layer_is_packed_and_a_prefill_gives_the_logits_of_the_unpacked_model(
    variant: str, tiny_dir: Path, hf_checkpoints: dict[str, Path]
) -> None:
    folder = tiny_dir if variant == "tiny" else hf_checkpoints[variant]
    on, off = make_runner(folder), make_runner(folder, prepack_weights=False)
    assert all(p is not None for p in packs(on))
    assert all(p is None for p in packs(off))
    packed, plain = prefill_logits(on), prefill_logits(off)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))
