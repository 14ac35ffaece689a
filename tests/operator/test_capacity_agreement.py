"""CapacityFits never says a model fits that the engine refuses to load (issue #29): both sides, swept.

The operator's side is ``capacity_verdict`` on a parsed InferenceService spec. The engine's side
is what it calls before it allocates: :func:`kvfleet.capacity.check_engine_fits`, and the KV-block
budget of its CUDA path (total × utilisation − activation reserve − used, in whole blocks) from
:func:`kvfleet.capacity.kv_cache_budget_bytes` and :func:`kvfleet.capacity.kv_blocks`, with used =
the rank's weights + the CUDA/NCCL overhead, as the engine would measure after a load that went to
plan. Over many (shape, tp, GPU, max_model_len, block size, utilisation), the three must agree.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet import capacity
from kvfleet.operator.capacity_status import capacity_verdict
from kvfleet.operator.spec import parse_inferenceservice

# Shapes the engine splits in each way: even (8 KV heads), replicated past few KV heads (2, 4),
# uneven (3 KV heads), and one that no tp > 4 splits (Qwen2: 28 query heads over 4 KV heads).
CUSTOM = {
    "gqa2": {"num_attention_heads": 16, "num_key_value_heads": 2, "hidden_size": 2048},
    "gqa3": {"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 1536},
}
KNOWN = ["llama-3-8b", "llama-3-70b", "llama-3.2-1b", "qwen2-7b", "mistral-7b"]
GPUS = ["h100", "a100-40gb", "l4", "h200"]
TPS = range(1, 9)
LENGTHS = [1024, 8192, 32768]
ENGINE = [(16, 0.9), (32, 0.5)]  # (blockSize, gpuMemoryUtilization)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """spec.model.architecture for each shape: a known name, or a folder holding a config.json."""
    out = {name: name for name in KNOWN}
    for name, fields in CUSTOM.items():
        folder = tmp_path_factory.mktemp(name)
        config = {
            "num_hidden_layers": 24,
            "intermediate_size": 8192,
            "vocab_size": 50000,
            "max_position_embeddings": 32768,
            **fields,
        }
        (folder / "config.json").write_text(json.dumps(config))
        out[name] = str(Path(folder))
    return out


def operator_status(arch: str, tp: int, gpu: str, length: int, block: int, util: float) -> Any:
    body = {
        "model": {"name": "m", "uri": "file:///m", "architecture": arch, "maxModelLen": length},
        "engine": {"blockSize": block, "gpuMemoryUtilization": util},
        "resources": {"gpus": tp, "gpuType": gpu},
    }
    return capacity_verdict(parse_inferenceservice(body))[0]


def engine_fits(shape: capacity.ModelShape, tp: int, gpu: str, length: int, block: int, util: float) -> bool:
    memory = capacity.resolve_gpu(gpu).memory_bytes
    verdict = capacity.check_engine_fits(shape, "bfloat16", tp, memory, util, length, block)
    return verdict.fits


def engine_blocks(shape: capacity.ModelShape, tp: int, gpu: str, block: int, util: float) -> int:
    """The runner's CUDA path, through capacity's functions: the blocks it would allocate."""
    memory = capacity.resolve_gpu(gpu).memory_bytes
    used = capacity.per_rank_weights_bytes(shape, "bf16", tp) + capacity.RANK_RUNTIME_OVERHEAD_BYTES
    reserve = capacity.activation_reserve_bytes(shape, "bf16", tp, memory)
    budget = capacity.kv_cache_budget_bytes(memory, used, util, reserve)
    return capacity.kv_blocks(budget, block * capacity.per_rank_kv_bytes_per_token(shape, "bf16", tp))


def cases(models: dict[str, str]) -> list[tuple[Any, ...]]:
    return [
        (arch, capacity.resolve_model(arch), tp, gpu, length, block, util)
        for (arch, tp, gpu, length, (block, util)) in itertools.product(
            models.values(), TPS, GPUS, LENGTHS, ENGINE
        )
    ]


def test_capacity_fits_and_the_engines_verdict_agree_on_every_combination(models: dict[str, str]) -> None:
    seen = {"True": 0, "False": 0}
    for arch, shape, tp, gpu, length, block, util in cases(models):
        status = operator_status(arch, tp, gpu, length, block, util)
        if length > shape.max_position_embeddings:  # the engine refuses such a length itself
            assert (status.status, status.reason) == ("False", "InvalidForModel")
            continue
        engine = engine_fits(shape, tp, gpu, length, block, util)
        assert (status.status == "True") == engine, (arch, tp, gpu, length, block, util, status.message)
        seen[status.status] += 1
    assert seen["True"] > 300 and seen["False"] > 300, seen  # the sweep crosses the line many times


def test_the_engines_kv_blocks_hold_one_full_sequence_exactly_when_capacity_fits_says_so(
    models: dict[str, str],
) -> None:
    for arch, shape, tp, gpu, length, block, util in cases(models):
        if length > shape.max_position_embeddings:
            continue
        status = operator_status(arch, tp, gpu, length, block, util)
        splits = capacity.tp_split_error(shape.num_heads, shape.num_kv_heads, tp) is None
        holds_one = engine_blocks(shape, tp, gpu, block, util) >= capacity.blocks_for(length, block)
        assert (status.status == "True") == (splits and holds_one), (arch, tp, gpu, length, status.message)
        if status.status == "True":
            assert status.figures["kvBlocks"] == engine_blocks(shape, tp, gpu, block, util)
