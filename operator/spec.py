"""The operator reads an InferenceService or TenantQuota spec here (docs/architecture.md §7).

The models are :mod:`kvfleet.resources` (the router reads the same ones); the CRDs in
``crds/`` are what the API server validates and defaults, and the models repeat it, so
the operator reads the same values whether or not the server applied them (an old CRD,
an emulator). Anything the schema or its CEL rules would have refused becomes a
:class:`SpecError` naming the field, never an exception that crash-loops a handler.
``tests/operator/test_crds.py`` and ``tests/kvfleet/test_resources.py`` keep them in step.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvfleet.resources import InferenceServiceSpec, TenantQuotaSpec

__all__ = [
    "InferenceServiceSpec",
    "SpecError",
    "TenantQuotaSpec",
    "parse_inferenceservice",
    "parse_tenantquota",
]

MODEL_SCHEMES = ("pvc://", "hf://", "file://")


class SpecError(ValueError):
    """A spec the schema would refuse: names the field and the rule."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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
    _check_adapters(spec)
    _check_engine_kind(spec)
    auto = spec.autoscaling
    if auto is not None and auto.min_replicas > auto.max_replicas:
        raise SpecError(
            "spec.autoscaling.minReplicas", f"{auto.min_replicas} must be <= maxReplicas {auto.max_replicas}"
        )
    if auto is not None and auto.min_replicas == 0 and not auto.scale_to_zero:
        raise SpecError("spec.autoscaling.minReplicas", "0 needs scaleToZero: true")


def _check_engine_kind(spec: InferenceServiceSpec) -> None:
    """The fields only kvfleet's engine takes (the CRD's CEL rules on spec.engine)."""
    eng = spec.engine
    if eng.kind == "vllm" and eng.attention is not None:
        raise SpecError(
            "spec.engine.attention", "kind vllm takes no attention backend (kvfleet's engine only)"
        )
    if eng.kind == "vllm" and eng.simulate:
        raise SpecError("spec.engine.simulate", "kind vllm has no simulated mode (kvfleet's engine only)")
    if eng.kind == "vllm" and eng.quantization == "int8":
        raise SpecError(
            "spec.engine.quantization", "int8 is kvfleet's CPU format; kind vllm takes fp8 or gguf"
        )


def _check_adapters(spec: InferenceServiceSpec) -> None:
    seen: set[str] = set()
    for i, adapter in enumerate(spec.adapters):
        field = f"spec.adapters[{i}]"
        if not adapter.uri.startswith(MODEL_SCHEMES) or adapter.uri in MODEL_SCHEMES:
            raise SpecError(
                f"{field}.uri", f"{adapter.uri!r} must be pvc://CLAIM[/PATH], hf://ORG/NAME or file:///PATH"
            )
        if adapter.uri.startswith("pvc://") and not adapter.uri[len("pvc://") :].split("/")[0]:
            raise SpecError(f"{field}.uri", f"{adapter.uri!r} names no PersistentVolumeClaim")
        if adapter.name == spec.model.name:
            raise SpecError(
                f"{field}.name", f"{adapter.name!r} is the model's name; an adapter needs its own"
            )
        if adapter.name in seen:
            raise SpecError(
                f"{field}.name", f"{adapter.name!r} names two adapters; adapter names must be unique"
            )
        seen.add(adapter.name)


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
