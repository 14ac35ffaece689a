"""The runner keeps each layer's linears packed for a GEMM library, and the model's output does not move.

``EngineConfig.prepack_weights`` (default on): after loading, every layer holds a packed copy
(MKL's, oneDNN's or the native panels, ``EngineConfig.weight_packing``) of its q/k/v, o_proj, gate/up and
down_proj weights, which steps of more than 16 rows read (kernels/packing). The logits of a 40-row prefill equal those with it off up to
float32 summation order, biases (qwen2) included; the greedy-token tests against
transformers run with it on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels.packing.mkl import MklPackedWeight
from kvfleet.engine.kernels.packing.native import NativePackedWeight
from kvfleet.engine.kernels.packing.onednn import OnednnPackedWeight
from kvfleet.engine.runner.model_runner import ModelRunner

AVAILABLE = {
    "mkl": MklPackedWeight.available(),
    "onednn": OnednnPackedWeight.available(),
    "native": NativePackedWeight.available(),
}
ROWS = 40


def make_runner(folder: Path, **overrides: bool | str) -> ModelRunner:
    config = EngineConfig(
        model=str(folder), num_kv_blocks=16, block_size=16, attention_backend="torch", **overrides
    )
    return ModelRunner(config, folder)


def packs(runner: ModelRunner) -> list[object]:
    return [runner.model.packed_lm_head] + [
        p
        for layer in runner.model.model.layers
        for p in (
            layer.self_attn.packed_in,
            layer.self_attn.packed_out,
            layer.mlp.packed_in,
            layer.mlp.packed_out,
        )
    ]


def prefill_logits(runner: ModelRunner, sample_rows: torch.Tensor) -> torch.Tensor:
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
        return runner.model(ids, torch.arange(ROWS), runner.kv_caches, meta, runner.backend, sample_rows)


@pytest.mark.parametrize("packing", ["mkl", "onednn", "native"])
@pytest.mark.parametrize("variant", ["tiny", "qwen2-tied"])
def test_every_layer_is_packed_and_a_prefill_gives_the_logits_of_the_unpacked_model(
    variant: str, packing: str, tiny_dir: Path, hf_checkpoints: dict[str, Path]
) -> None:
    if not AVAILABLE[packing]:
        pytest.skip(f"this torch build cannot pack for {packing}")
    folder = tiny_dir if variant == "tiny" else hf_checkpoints[variant]
    on, off = make_runner(folder, weight_packing=packing), make_runner(folder, prepack_weights=False)
    assert on.weight_packing == packing and off.weight_packing is None
    assert all(p is not None for p in packs(on))
    assert all(p is None for p in packs(off))
    # one sampling row: the LM head on the native few-row kernel; every row: on the packed LM head
    for rows in (torch.tensor([ROWS - 1]), torch.arange(ROWS)):
        packed, plain = prefill_logits(on, rows), prefill_logits(off, rows)
        torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
        assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_auto_packing_picks_a_library_this_machine_has(tiny_dir: Path) -> None:
    runner = make_runner(tiny_dir)
    assert runner.weight_packing in {name for name, ok in AVAILABLE.items() if ok} | {None}
    assert (runner.weight_packing is None) == (not any(AVAILABLE.values()))
