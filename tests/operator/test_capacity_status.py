"""CapacityFits and status.capacity from the shared capacity maths (kvfleet.capacity)."""

from __future__ import annotations

from typing import Any

from kvfleet import capacity
from kvfleet.operator.capacity_status import capacity_verdict, figures
from kvfleet.operator.spec import parse_inferenceservice


def verdict(model: str = "llama-3-8b", **resources: Any) -> Any:
    return capacity_verdict(
        parse_inferenceservice({"model": {"name": model, "uri": "file:///w"}, "resources": resources})
    )


def test_a_model_that_fits_reports_the_plans_figures() -> None:
    cap, blockers = verdict(gpuType="h100")
    plan = capacity.plan_capacity(capacity.KNOWN_MODELS["llama-3-8b"], capacity.resolve_gpu("h100"))
    assert (cap.status, cap.reason, blockers) == ("True", "Fits", [])
    assert cap.figures == figures(plan, "h100")
    assert cap.figures == {
        "gpuType": "h100",
        "numGpus": 1,
        "tensorParallelSize": 1,
        "weightsBytes": plan.weights_bytes,
        "kvBytesPerToken": 131072,
        "weightsBytesPerGpu": plan.weights_bytes,
        "kvHeadsPerGpu": 8,
        "kvBytesPerTokenPerGpu": 131072,
        "kvCacheBytesPerGpu": plan.kv_bytes,
        "kvBlocks": plan.kv_blocks,
        "kvTokens": plan.kv_tokens,
        "maxConcurrentSequences": plan.max_concurrent_sequences,
        "decodeTokensPerSecondBound": round(plan.decode_tokens_per_s_bound, 1),
    }


def test_weights_too_big_for_the_gpus_are_capacity_fits_false_with_the_numbers_and_block() -> None:
    cap, blockers = verdict("llama-3-70b", gpuType="l4")
    assert (cap.status, cap.reason) == ("False", "InsufficientGPUMemory")
    assert cap.message.startswith(
        "llama-3-70b on 1 × L4 24GB (tensor-parallel size 1): per GPU, used 142181154816 bytes "
        "(weights 141107412992) + activation reserve 1507065856 bytes exceed the usable 23192823398 bytes"
    )
    assert [b.reason for b in blockers] == ["InsufficientGPUMemory"]
    assert verdict("llama-3-70b", gpuType="h100", gpus=4)[0].status == "True"


def test_an_unknown_gpu_type_blocks_and_an_unknown_model_shape_only_says_unknown() -> None:
    gpu, gpu_blockers = verdict(gpuType="x100")
    assert (gpu.status, gpu.reason, [b.reason for b in gpu_blockers]) == (
        "Unknown",
        "UnknownGPUType",
        ["UnknownGPUType"],
    )
    assert gpu.message.startswith("spec.resources.gpuType 'x100': unknown GPU 'x100'")
    shape, shape_blockers = verdict("my-own-model", gpuType="h100")
    assert (shape.status, shape.reason, shape_blockers) == ("Unknown", "UnknownModelShape", [])


def test_a_context_longer_than_the_model_is_refused_by_the_maths() -> None:
    spec = {
        "model": {"name": "llama-3-8b", "uri": "file:///w", "maxModelLen": 100000},
        "resources": {"gpuType": "h100"},
    }
    cap, blockers = capacity_verdict(parse_inferenceservice(spec))
    assert (cap.status, cap.reason, [b.reason for b in blockers]) == (
        "False",
        "InvalidForModel",
        ["InvalidForModel"],
    )


def test_without_gpus_or_a_gpu_type_nothing_is_checked() -> None:
    assert verdict(gpus=0)[0].reason == "NoGPUs"
    assert verdict()[0].reason == "NoGPUType"


def test_a_tensor_parallel_size_the_heads_cannot_split_over_is_refused_with_the_engines_reason() -> None:
    """Llama-3-8B has 8 KV heads: 3 GPUs split them 3+3+2 (allowed); Qwen2-7B's 4 KV heads over
    3 GPUs are fine too, but 28 query heads over 8 GPUs (> 4 KV heads, so replicated) are not."""
    assert verdict(gpuType="h100", gpus=3)[0].status == "True"
    cap, blockers = verdict("qwen2-7b", gpuType="h100", gpus=8)
    assert (cap.status, cap.reason, [b.reason for b in blockers]) == (
        "False",
        "InvalidTensorParallelSize",
        ["InvalidTensorParallelSize"],
    )
    assert cap.message.endswith("tensor-parallel size 8 does not divide the 28 query heads")
    assert verdict("qwen2-7b", gpuType="h100", gpus=6)[0].reason == "InvalidTensorParallelSize"  # 6 % 4
