"""The InferenceService and TenantQuota specs as typed models (DESIGN.md §7).

The CRDs in ``crds/`` are what the API server validates and defaults; these models
repeat the same defaults so the operator reads the same values whether or not the
server applied them (an old CRD, an emulator), and turn anything the schema would
have refused into :class:`SpecError` naming the field, never an exception that
crash-loops a handler. ``tests/operator/test_crds.py`` keeps both in step.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

MODEL_SCHEMES = ("pvc://", "hf://", "file://")
ROUTING_POLICIES = ("round-robin", "least-request", "kv-aware", "prefix-aware")


class SpecError(ValueError):
    """A spec the schema would refuse: names the field and the rule."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class ModelCredentialsRef(_Camel):
    """A Secret whose key holds the Hugging Face token for ``hf://`` sources."""

    name: str = Field(min_length=1)
    key: str = Field(default="token", min_length=1)


class ApiKeySecretRef(_Camel):
    """A Secret whose key holds the tenant's API key (the router reads it)."""

    name: str = Field(min_length=1)
    key: str = Field(default="api-key", min_length=1)


class ModelSpec(_Camel):
    name: str = Field(min_length=1, max_length=256)
    uri: str
    architecture: str | None = None
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    max_model_len: int | None = Field(default=None, ge=1)
    credentials_secret_ref: ModelCredentialsRef | None = None


class EngineSpec(_Camel):
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    block_size: Literal[8, 16, 32, 64, 128] = 16
    max_num_seqs: int = Field(default=256, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    prefix_caching: bool = True
    attention: Literal["torch", "triton"] | None = None
    simulate: bool = False
    drain_seconds: int = Field(default=60, ge=0, le=3600)


class ResourcesSpec(_Camel):
    gpus: int = Field(default=1, ge=0, le=8)
    gpu_resource_name: str = "nvidia.com/gpu"
    gpu_type: str | None = None
    cpu: int | str | None = None
    memory: int | str | None = None


class AutoscalingSpec(_Camel):
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(ge=1)
    target_queue_depth: int = Field(default=4, ge=1)
    target_kv_cache_usage: float = Field(default=0.8, gt=0.0, le=1.0)
    tolerance: float = Field(default=0.1, ge=0.0, lt=1.0)
    scale_up_stabilization_seconds: int = Field(default=0, ge=0)
    scale_down_stabilization_seconds: int = Field(default=300, ge=0)
    scale_to_zero: bool = False


class SLOSpec(_Camel):
    ttft_ms: int | None = Field(default=None, ge=1)
    tpot_ms: int | None = Field(default=None, ge=1)


class RoutingSpec(_Camel):
    policy: Literal["round-robin", "least-request", "kv-aware", "prefix-aware"] | None = None


class Toleration(_Camel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class PlacementSpec(_Camel):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None


class InferenceServiceSpec(_Camel):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    replicas: int = Field(default=1, ge=0)
    autoscaling: AutoscalingSpec | None = None
    slo: SLOSpec | None = None
    routing: RoutingSpec | None = None
    placement: PlacementSpec = Field(default_factory=PlacementSpec)


class TenantLimits(_Camel):
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    max_queued_requests: int | None = Field(default=None, ge=0)
    max_tokens_per_request: int | None = Field(default=None, ge=1)


class TenantQuotaSpec(_Camel):
    tenant: str = Field(min_length=1, max_length=253)
    api_key_secret_ref: ApiKeySecretRef
    models: list[str] = Field(default_factory=list)
    limits: TenantLimits = Field(default_factory=TenantLimits)
    priority: int = Field(default=0, ge=0, le=1000)
    weight: int = Field(default=1, ge=1, le=1000)


def _first_error(exc: ValidationError, root: str) -> SpecError:
    err = exc.errors()[0]
    path = ".".join([root, *(str(p) for p in err["loc"])])
    return SpecError(path, err["msg"])


# The semantic rules below are the CRD's CEL rules (crds/*.yaml x-kubernetes-validations),
# checked again here because the operator must not trust that the server ran them.
def _check_inferenceservice(spec: InferenceServiceSpec) -> None:
    if not spec.model.uri.startswith(MODEL_SCHEMES):
        raise SpecError(
            "spec.model.uri", f"{spec.model.uri!r} must start with one of {', '.join(MODEL_SCHEMES)}"
        )
    if spec.model.uri.startswith("pvc://") and not spec.model.uri[len("pvc://") :].split("/")[0]:
        raise SpecError("spec.model.uri", f"{spec.model.uri!r} names no PersistentVolumeClaim")
    if spec.engine.max_num_batched_tokens < spec.engine.max_num_seqs:
        raise SpecError(
            "spec.engine.maxNumBatchedTokens",
            f"{spec.engine.max_num_batched_tokens} must be >= maxNumSeqs {spec.engine.max_num_seqs}",
        )
    if spec.resources.gpus == 0 and spec.resources.gpu_type is not None:
        raise SpecError("spec.resources.gpuType", f"{spec.resources.gpu_type!r} needs gpus > 0")
    auto = spec.autoscaling
    if auto is not None and auto.min_replicas > auto.max_replicas:
        raise SpecError(
            "spec.autoscaling.minReplicas", f"{auto.min_replicas} must be <= maxReplicas {auto.max_replicas}"
        )
    if auto is not None and auto.min_replicas == 0 and not auto.scale_to_zero:
        raise SpecError("spec.autoscaling.minReplicas", "0 needs scaleToZero: true")


def parse_inferenceservice(spec: dict[str, Any]) -> InferenceServiceSpec:
    """The typed spec, with the CRD's defaults; :class:`SpecError` names the first bad field."""
    try:
        parsed = InferenceServiceSpec.model_validate(spec)
    except ValidationError as exc:
        raise _first_error(exc, "spec") from None
    _check_inferenceservice(parsed)
    return parsed


def parse_tenantquota(spec: dict[str, Any]) -> TenantQuotaSpec:
    try:
        parsed = TenantQuotaSpec.model_validate(spec)
    except ValidationError as exc:
        raise _first_error(exc, "spec") from None
    lim = parsed.limits
    if (
        lim.max_tokens_per_request
        and lim.tokens_per_minute
        and lim.max_tokens_per_request > lim.tokens_per_minute
    ):
        raise SpecError(
            "spec.limits.maxTokensPerRequest",
            f"{lim.max_tokens_per_request} must be <= tokensPerMinute {lim.tokens_per_minute}",
        )
    return parsed
