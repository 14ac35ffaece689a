"""The CapacityFits verdict and ``status.capacity`` figures, from the shared capacity maths.

``kvfleet.capacity`` (torch-free, docs/architecture.md §4) does the arithmetic; this module decides
what the spec asks of it and how the answer reads in the status:

- no GPUs, or no ``spec.resources.gpuType``: CapacityFits=Unknown (nothing to check against);
- a model shape the maths does not know (``spec.model.architecture`` or else
  ``spec.model.name`` must name a known model): Unknown, reason UnknownModelShape;
- a GPU type it does not know: Unknown, reason UnknownGPUType, and the spec is blocked
  (a typo in gpuType must not roll out silently);
- a plan that does not fit: False with the numbers, and the spec is blocked. The verdict is
  :func:`kvfleet.capacity.check_engine_fits`, the one the engine itself calls before it
  allocates, on one GPU of ``gpus`` = the tensor-parallel size: heads that do not split over
  the ranks (InvalidTensorParallelSize), a rank's weights, overhead and activation reserve over
  its usable memory, or KV blocks short of one sequence of maxModelLen (InsufficientGPUMemory),
  or a context longer than the model's (InvalidForModel).
"""

from __future__ import annotations

from typing import Any

from kvfleet import capacity

from .spec import InferenceServiceSpec
from .status import Blocker, CapacityVerdict


def figures(plan: capacity.CapacityPlan, gpu_type: str) -> dict[str, Any]:
    """``status.capacity``: the plan's figures in the CRD's camelCase names."""
    return {
        "gpuType": gpu_type,
        "numGpus": int(plan.num_gpus),
        "tensorParallelSize": int(plan.num_gpus),
        "weightsBytes": int(plan.weights_bytes),
        "kvBytesPerToken": int(plan.kv_bytes_per_token),
        "weightsBytesPerGpu": int(plan.weights_bytes_per_rank),
        "kvHeadsPerGpu": int(plan.kv_heads_per_rank),
        "kvBytesPerTokenPerGpu": int(plan.kv_bytes_per_token_per_rank),
        "kvCacheBytesPerGpu": int(plan.kv_bytes),
        "kvBlocks": int(plan.kv_blocks),
        "kvTokens": int(plan.kv_tokens),
        "maxConcurrentSequences": int(plan.max_concurrent_sequences),
        "decodeTokensPerSecondBound": round(float(plan.decode_tokens_per_s_bound), 1),
    }


def _unknown(reason: str, message: str) -> tuple[CapacityVerdict, list[Blocker]]:
    return CapacityVerdict("Unknown", reason, message), []


def capacity_verdict(spec: InferenceServiceSpec) -> tuple[CapacityVerdict, list[Blocker]]:
    """The verdict, and the blockers it implies (empty unless the spec must not roll out)."""
    res, model = spec.resources, spec.model
    if res.gpus == 0:
        return _unknown("NoGPUs", "spec.resources.gpus is 0: nothing to check")
    if res.gpu_type is None:
        return _unknown("NoGPUType", "spec.resources.gpuType is not set: capacity not checked")
    try:
        gpu = capacity.resolve_gpu(res.gpu_type)
    except ValueError as err:
        message = f"spec.resources.gpuType {res.gpu_type!r}: {err}"
        return CapacityVerdict("Unknown", "UnknownGPUType", message), [Blocker("UnknownGPUType", message)]
    shape_name = model.architecture or model.name
    try:
        shape = capacity.resolve_model(shape_name)
    except (ValueError, OSError) as err:
        field = "spec.model.architecture" if model.architecture else "spec.model.name"
        return _unknown("UnknownModelShape", f"{field} {shape_name!r}: {err}")
    try:
        plan = capacity.plan_capacity(
            shape,
            gpu,
            num_gpus=res.gpus,
            context=model.max_model_len,
            dtype=model.dtype or "bfloat16",
            gpu_memory_utilization=spec.engine.gpu_memory_utilization,
            max_num_batched_tokens=spec.engine.max_num_batched_tokens,
            max_num_seqs=spec.engine.max_num_seqs,
            block_size=spec.engine.block_size,
            # fp8 is the one GPU format; gguf's bytes depend on the file's block types: counted in the dtype
            quantization="fp8" if spec.engine.quantization == "fp8" else None,
        )
    except ValueError as err:
        message = f"spec.model.maxModelLen {model.max_model_len}: {err}"
        return CapacityVerdict("False", "InvalidForModel", message), [Blocker("InvalidForModel", message)]
    where = f"{shape.name} on {res.gpus} × {gpu.name} (tensor-parallel size {res.gpus})"
    if not plan.fits:
        unsplittable = capacity.tp_split_error(shape.num_heads, shape.num_kv_heads, res.gpus)
        reason = "InvalidTensorParallelSize" if unsplittable else "InsufficientGPUMemory"
        message = f"{where}: {plan.reason}"
        return CapacityVerdict("False", reason, message, figures(plan, res.gpu_type)), [
            Blocker(reason, message)
        ]
    message = (
        f"{where}: {plan.weights_bytes_per_rank} bytes of weights and {plan.kv_bytes} of KV cache per GPU, "
        f"{plan.kv_tokens} KV tokens, {plan.max_concurrent_sequences} sequences at full context"
    )
    return CapacityVerdict("True", "Fits", message, figures(plan, res.gpu_type)), []
