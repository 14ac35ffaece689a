"""The runner's CUDA KV budget and the operator's CapacityFits give one verdict (issue #29).

``engine/runner/model_runner.py``'s :func:`gpu_kv_budget` is what a GPU engine calls once its weights are in; the
operator's ``capacity_verdict`` is what an InferenceService's status says before any pod runs. Fed
the bytes the operator predicts as used, the runner must load exactly the models the status says
fit, and size the KV cache the status reports; where the status says no, the runner refuses with
the same reason instead of starting with a cache that cannot hold one sequence.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from kvfleet import capacity
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.model.config import ModelLoadError
from kvfleet.engine.runner.model_runner import gpu_kv_budget
from kvfleet.operator.capacity_status import capacity_verdict
from kvfleet.operator.spec import parse_inferenceservice

SHAPES = ["llama-3-70b", "llama-3-8b", "qwen2-7b"]  # even, and one no tp > 4 splits (28 heads over 4)


def config_json(folder: Path, shape: capacity.ModelShape) -> Path:
    """A Hugging Face config.json of ``shape`` (what the engine reads from a checkpoint folder)."""
    fields = {
        "model_type": "qwen2" if shape.attention_bias else "llama",
        "num_hidden_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "max_position_embeddings": shape.max_position_embeddings,
    }
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


@pytest.mark.parametrize("name", SHAPES)
def test_the_runner_loads_exactly_what_capacity_fits_says_fits_and_sizes_its_cache_alike(
    name: str, tmp_path: Path
) -> None:
    shape = dataclasses.replace(capacity.resolve_model(name), name=name)
    folder = config_json(tmp_path / name, shape)
    crossed = set()
    for tp, gpu, length, util in itertools.product([1, 2, 4, 8], ["h100", "l4"], [1024, 8192], [0.9, 0.6]):
        body = {
            "model": {"name": "m", "uri": "file:///m", "architecture": str(folder), "maxModelLen": length},
            "engine": {"blockSize": 16, "gpuMemoryUtilization": util},
            "resources": {"gpus": tp, "gpuType": gpu},
        }
        status = capacity_verdict(parse_inferenceservice(body))[0]
        total = capacity.resolve_gpu(gpu).memory_bytes
        used = capacity.per_rank_weights_bytes(shape, "bfloat16", tp) + capacity.RANK_RUNTIME_OVERHEAD_BYTES
        config = EngineConfig(
            tensor_parallel_size=tp, max_num_batched_tokens=8192, gpu_memory_utilization=util
        )
        if status.status == "True":
            budget = gpu_kv_budget(config, folder, torch.bfloat16, length, used=used, total=total)
            assert budget == status.figures["kvCacheBytesPerGpu"], (tp, gpu, length, util)
        else:
            with pytest.raises(ModelLoadError, match="does not fit"):
                gpu_kv_budget(config, folder, torch.bfloat16, length, used=used, total=total)
        crossed.add(status.status)
    assert crossed == {"True", "False"}  # each shape is swept across the line
