"""The specs of kvfleet's Kubernetes resources, once: the models of ``crds/*.yaml`` (docs/architecture.md §7).

Where it sits: beside :mod:`kvfleet.protocol`, torch-free and importing no part. The
operator parses every InferenceService and TenantQuota with them
(:mod:`kvfleet.operator.spec`, which adds the CRDs' CEL rules as :class:`SpecError`\\ s);
the router reads the same models from the cluster (``spec.autoscaling``, ``spec.slo``,
a TenantQuota's tenant, models and limits) and from its ``--tenants`` file; ``kvfleet up``
builds an :class:`AutoscalingSpec` for its local fleet.

Every field, type, default, enum and bound of the CRD schema is the model's and back
(``tests/kvfleet/test_resources.py`` walks both): the server validates and defaults, and
the models repeat it, so a reader gets the same values whether or not the server applied
them (an old CRD, an emulator, a file). Two bounds the CRD states only as CEL rules
(``gpuMemoryUtilization``, ``targetKVCacheUsage`` in (0, 1]) are validators here, not
schema bounds. Field names are snake_case; the aliases are the CRD's camelCase, and either
is accepted. Unknown fields are ignored, as the API server prunes them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict


class CamelModel(BaseModel):
    """A CRD object: camelCase aliases, snake_case names, unknown fields pruned, immutable."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


def _in_unit_interval(v: float) -> float:
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{v} must be in (0, 1]")
    return v


class ModelCredentialsRef(CamelModel):
    """A Secret whose key holds the Hugging Face token for ``hf://`` sources."""

    name: str = Field(min_length=1)
    key: str = Field(default="token", min_length=1)


class ApiKeySecretRef(CamelModel):
    """A Secret whose key holds the tenant's API key (the router reads it)."""

    name: str = Field(min_length=1)
    key: str = Field(default="api-key", min_length=1)


class ModelSpec(CamelModel):
    name: str = Field(min_length=1, max_length=256)
    uri: str = Field(max_length=1024)  # the CRD bounds it: its CEL rule's cost must fit the budget
    architecture: str | None = None
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    max_model_len: int | None = Field(default=None, ge=1)
    credentials_secret_ref: ModelCredentialsRef | None = None


ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][-A-Za-z0-9_.]*$"  # a served model name, a flag value, a metric label
MAX_ADAPTERS = 64


class AdapterSpec(CamelModel):
    """One LoRA adapter of ``spec.adapters``: the name clients send as ``model``, where its PEFT files are."""

    name: str = Field(min_length=1, max_length=128, pattern=ADAPTER_NAME_PATTERN)
    uri: str = Field(max_length=1024)  # pvc://, hf:// or file:// (a CEL rule of the CRD)


ReasoningParserName = Literal["deepseek_r1", "openai_gptoss", "qwen3"]


class EngineSpec(CamelModel):
    # kvfleet's own engine, or vLLM's OpenAI server (kvfleet.protocol.ENGINE_KINDS; docs/architecture.md §7)
    kind: Literal["kvfleet", "vllm"] = "kvfleet"
    image: str | None = Field(default=None, min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    block_size: Literal[8, 16, 32, 64, 128] = 16
    max_num_seqs: int = Field(default=256, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    gpu_memory_utilization: float = 0.9  # in (0, 1]: a CEL rule of the CRD
    prefix_caching: bool = True
    attention: Literal["torch", "triton"] | None = None
    simulate: bool = False
    max_loras: int = Field(default=4, ge=1, le=MAX_ADAPTERS)  # adapters resident on the device at once
    max_lora_rank: int = Field(default=16, ge=1, le=512)
    drain_seconds: int = Field(default=60, ge=0, le=3600)
    # the weights' format (--quantization, vLLM's flag): fp8 on GPUs, int8 and gguf on the CPU
    quantization: Literal["fp8", "int8", "gguf"] | None = None
    # how the model writes its reasoning (--reasoning-parser, vLLM's flag and names; the engine's registry)
    reasoning_parser: ReasoningParserName | None = None

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _gpu_memory_utilization_in_unit_interval(cls, v: float) -> float:
        return _in_unit_interval(v)


class ResourcesSpec(CamelModel):
    gpus: int = Field(default=1, ge=0, le=8)  # GPUs per engine pod = tensor-parallel size (one node)
    gpu_resource_name: str = Field(default="nvidia.com/gpu", min_length=1)
    gpu_type: str | None = None
    cpu: int | str | None = None
    memory: int | str | None = None


class AutoscalingSpec(CamelModel):
    """``spec.autoscaling``: the router's autoscaler reads it (Kubernetes HPA semantics)."""

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(ge=1)
    target_queue_depth: int = Field(default=4, ge=1)
    target_kv_cache_usage: float = Field(default=0.8, alias="targetKVCacheUsage")  # in (0, 1]: CEL
    tolerance: float = Field(default=0.1, ge=0.0, le=0.99)
    scale_up_stabilization_seconds: int = Field(default=0, ge=0)
    scale_down_stabilization_seconds: int = Field(default=300, ge=0)
    scale_to_zero: bool = False

    @field_validator("target_kv_cache_usage")
    @classmethod
    def _target_kv_cache_usage_in_unit_interval(cls, v: float) -> float:
        return _in_unit_interval(v)


class SLOSpec(CamelModel):
    """``spec.slo``: the goodput definition; a target left out is not judged."""

    ttft_ms: int | None = Field(default=None, ge=1)
    tpot_ms: int | None = Field(default=None, ge=1)
    # The bound on a stream's gaps between tokens: not judged in goodput (TPOT is); each engine gets
    # it as --target-step-ms: its stall-free scheduler (issue #33) lets prefill fill a step up to it,
    # the step bound being max(it, --stall-free-factor x a decode step: the running decodes', or the one
    # midway to the batch they make with the prompts waiting).
    itl_p99_ms: int | None = Field(default=None, ge=1)


class RoutingSpec(CamelModel):
    policy: Literal["round-robin", "least-request", "kv-aware", "prefix-aware", "adapter-aware"] | None = None
    # Tenants reuse each other's prefix-cache blocks; None: the router's --shared-prefix-cache.
    shared_prefix_cache: bool | None = None


class Toleration(CamelModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class PlacementSpec(CamelModel):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None


_EMPTY: JsonDict = {"default": {}}  # the CRD defaults these objects to {} (then their fields' defaults)


class InferenceServiceSpec(CamelModel):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec, json_schema_extra=_EMPTY)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, json_schema_extra=_EMPTY)
    replicas: int = Field(default=1, ge=0)
    autoscaling: AutoscalingSpec | None = None
    slo: SLOSpec | None = None
    routing: RoutingSpec | None = None
    placement: PlacementSpec = Field(default_factory=PlacementSpec, json_schema_extra=_EMPTY)
    adapters: list[AdapterSpec] = Field(default_factory=list, max_length=MAX_ADAPTERS)


class TenantLimits(CamelModel):
    """``spec.limits`` of a TenantQuota; an absent limit is no limit."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    max_queued_requests: int | None = Field(default=None, ge=0)
    max_tokens_per_request: int | None = Field(default=None, ge=1)


class TenantSpec(CamelModel):
    """What the router enforces for a tenant: a TenantQuota spec without its Secret reference."""

    tenant: str = Field(min_length=1, max_length=253)
    models: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)  # empty: every model
    limits: TenantLimits = Field(default_factory=TenantLimits, json_schema_extra=_EMPTY)
    priority: int = Field(default=0, ge=0, le=1000)
    weight: int = Field(default=1, ge=1, le=1000)


class TenantQuotaSpec(TenantSpec):
    """A TenantQuota's ``spec``: the tenant's terms and the Secret that holds its API key."""

    api_key_secret_ref: ApiKeySecretRef
