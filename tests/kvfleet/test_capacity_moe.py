"""Capacity maths of a mixture of experts: every expert counts in the weights, ``active_params``
counts the top-k a token runs, tensor parallelism splits every expert, and decode reads only the
experts a step's tokens hit."""

import json

import pytest

from kvfleet.capacity import (
    decode_tokens_per_s_bound,
    model_shape_from_config,
    per_rank_params,
    per_rank_weights_bytes,
    plan_capacity,
    resolve_gpu,
    resolve_model,
)
from kvfleet.cli import main


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.4)],  # the model cards' counts
)
def test_known_moe_models_count_every_expert_and_report_the_active_ones(
    name: str, total: float, active: float
) -> None:
    shape = resolve_model(name)
    assert round(shape.num_params / 1e9, 1) == total
    assert round(shape.active_params / 1e9, 1) == active


def test_a_dense_models_active_params_are_all_of_them() -> None:
    shape = resolve_model("llama-3-8b")
    assert shape.active_params == shape.num_params


def test_a_qwen3_moe_config_reads_its_dense_layers_and_expert_width() -> None:
    config = {
        "model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 3, "intermediate_size": 96, "moe_intermediate_size": 40,
        "vocab_size": 259, "num_local_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1],
    }  # fmt: skip
    shape = model_shape_from_config(config)
    assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (8, 2, 40)
    assert shape.sparse_layers == 2 and shape.qk_norm


def test_tensor_parallelism_splits_every_experts_columns() -> None:
    shape = resolve_model("mixtral-8x7b")
    experts = shape.sparse_layers * shape.num_experts * 3 * shape.hidden_size * shape.expert_intermediate_size
    assert per_rank_params(shape, 1) - per_rank_params(shape, 2) > experts // 2
    assert per_rank_weights_bytes(shape, "bfloat16", 2) < per_rank_weights_bytes(shape, "bfloat16", 1) * 0.52


def test_decode_at_batch_one_reads_only_the_top_k_experts_and_a_large_batch_nearly_all() -> None:
    shape, gpu = resolve_model("mixtral-8x7b"), resolve_gpu("h100")
    one = decode_tokens_per_s_bound(shape, gpu, num_gpus=2, context=1, batch_size=1)
    bandwidth_bound_of_all = gpu.bandwidth_bytes_per_s / per_rank_weights_bytes(shape, "bfloat16", 2)
    assert one > 2.5 * bandwidth_bound_of_all  # 2 of 8 experts read: about a third of the bytes
    many = decode_tokens_per_s_bound(shape, gpu, num_gpus=2, context=1, batch_size=64)
    assert many == pytest.approx(64 * bandwidth_bound_of_all, rel=0.01)


def test_the_plan_reports_active_params_in_its_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_capacity(resolve_model("mixtral-8x7b"), resolve_gpu("h100"), num_gpus=2, context=4096)
    assert plan.to_dict()["active_params"] == resolve_model("mixtral-8x7b").active_params
    assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100", "--context", "4096"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("model mixtral-8x7b (46.70 B params, 12.88 B active), dtype bfloat16")
    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--json"]) == 0
    assert (
        json.loads(capsys.readouterr().out)["active_params"] == resolve_model("qwen3-30b-a3b").active_params
    )
