"""``spec.engine.kind: vllm``: vLLM's OpenAI server as an InferenceService's engine (docs/architecture.md §7).

Called by :mod:`kvfleet.operator.renderers` where it builds the engine container: everything
else the operator renders (the Deployment, its pod hardening, volumes and model fetch, the
Service, the PDB, the NetworkPolicy) is the same for both kinds. The container runs
``vllm serve MODEL`` on the engine port with vLLM's names for the spec's fields
(``--tensor-parallel-size`` = ``spec.resources.gpus``, ``--max-model-len``, ``--lora-modules``,
``--enable-prefix-caching``), probes vLLM's ``/health`` (it has no ``/ready``), and carries the
``kvfleet.dev/engine-kind=vllm`` label the router reads its load kind from
(:data:`kvfleet.protocol.LABEL_ENGINE_KIND`). The fields vLLM does not take
(``attention``, ``simulate``) are refused by the CRD's CEL rules and :mod:`.spec`.
"""

from __future__ import annotations

from kvfleet.protocol import DEFAULT_ENGINE_PORT

from .sources import Obj, adapter_sources, model_source
from .spec import InferenceServiceSpec

VLLM = "vllm"
# Where vLLM's caches go under the read-only root: the operator's writable cache volume.
VLLM_ENV = (
    ("HOME", "/var/cache/kvfleet"),
    ("HF_HOME", "/var/cache/kvfleet/hf"),
    ("VLLM_NO_USAGE_STATS", "1"),
)


def is_vllm(spec: InferenceServiceSpec) -> bool:
    return spec.engine.kind == VLLM


def shared_flags(spec: InferenceServiceSpec) -> list[str]:
    """The flags ``kvfleet engine`` and ``vllm serve`` both take, by vLLM's names (kvfleet's CLI
    follows vLLM's), in a fixed order: the engine's shape first."""
    eng, model = spec.engine, spec.model
    return [
        "--port", str(DEFAULT_ENGINE_PORT),
        "--served-model-name", model.name,
        "--max-num-seqs", str(eng.max_num_seqs),
        "--max-num-batched-tokens", str(eng.max_num_batched_tokens),
        "--block-size", str(eng.block_size),
        "--gpu-memory-utilization", f"{eng.gpu_memory_utilization:g}",
    ]  # fmt: skip


def shared_optional_flags(spec: InferenceServiceSpec) -> list[str]:
    """The optional flags both engines take alike, only where the spec sets them: the context length,
    the dtype, the tensor-parallel size (``spec.resources.gpus`` > 1), the weights' format, the
    reasoning parser."""
    args: list[str] = []
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.model.dtype is not None:
        args += ["--dtype", spec.model.dtype]
    if spec.resources.gpus > 1:
        args += ["--tensor-parallel-size", str(spec.resources.gpus)]
    if spec.engine.quantization is not None:
        args += ["--quantization", spec.engine.quantization]
    if spec.engine.reasoning_parser is not None:
        args += ["--reasoning-parser", spec.engine.reasoning_parser]
    return args


def lora_flags(spec: InferenceServiceSpec) -> list[str]:
    """The adapters both engines load at start (``--lora-modules NAME=PATH ...``), none without adapters."""
    if not spec.adapters:
        return []
    modules = [f"{name}={path}" for name, path in adapter_sources(spec).paths]
    eng = spec.engine
    return [
        "--lora-modules",
        *modules,
        "--max-loras",
        str(eng.max_loras),
        "--max-lora-rank",
        str(eng.max_lora_rank),
    ]


def vllm_args(spec: InferenceServiceSpec) -> list[str]:
    """``vllm serve`` arguments (vLLM's own flag names), in a fixed order; optional ones only when set."""
    caching = "--enable-prefix-caching" if spec.engine.prefix_caching else "--no-enable-prefix-caching"
    args = [model_source(spec.model.uri).path, *shared_flags(spec), "--host", "0.0.0.0", caching]
    args += shared_optional_flags(spec)
    if spec.adapters:
        args += ["--enable-lora", *lora_flags(spec)]
    return args


def vllm_container_overrides(spec: InferenceServiceSpec) -> Obj:
    """What a vLLM engine container changes in the kvfleet one: command, args, readiness, environment."""
    ready = {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 5,
        "timeoutSeconds": 5,
        "failureThreshold": 2,
    }
    return {
        "command": ["vllm", "serve"],
        "args": vllm_args(spec),
        "readinessProbe": ready,
        "env": [{"name": k, "value": v} for k, v in VLLM_ENV],
    }
