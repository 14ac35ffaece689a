"""The resource models are the CRDs: every field, type, default, enum and bound of crds/*.yaml is the
model's, and every one of the model's is the CRD's (kvfleet/resources.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from kvfleet.resources import AutoscalingSpec, EngineSpec, InferenceServiceSpec, TenantQuotaSpec

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"
# What both sides state about a value; descriptions, formats and x-kubernetes-* markers are not compared.
KEPT = (
    "type", "default", "enum", "minimum", "maximum", "minLength", "maxLength", "maxItems", "pattern", "required",
)  # fmt: skip


def crd_spec_schema(plural: str) -> dict[str, Any]:
    doc = yaml.safe_load((CRD_DIR / f"{plural}.kvfleet.dev.yaml").read_text())
    return dict(doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])


def canonical(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One schema (a CRD's or pydantic's) in one shape: refs resolved, ``X | None`` as X, no default None."""
    if "$ref" in schema:
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**defs[schema["$ref"].rsplit("/", 1)[1]], **rest}
    branches = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
    if len(branches) == 1:  # pydantic's Optional: the value's own schema
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        schema = {**canonical(branches[0], defs), **rest}
    out = {k: v for k, v in schema.items() if k in KEPT and not (k == "default" and v is None)}
    if "required" in out:
        out["required"] = sorted(out["required"])
    if len(branches) > 1:
        out["anyOf"] = [canonical(b, defs) for b in branches]
    if "properties" in schema:
        out["properties"] = {k: canonical(v, defs) for k, v in schema["properties"].items()}
    if "items" in schema:
        out["items"] = canonical(schema["items"], defs)
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = canonical(schema["additionalProperties"], defs)
    return out


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    return canonical(schema, schema.get("$defs", {}))


def differences(crd: Any, model: Any, path: str = "spec") -> list[str]:
    """Every place the two trees differ, both ways."""
    if isinstance(crd, dict) and isinstance(model, dict):
        found: list[str] = []
        for key in sorted(set(crd) | set(model)):
            if key not in model:
                found.append(f"{path}.{key}: in the CRD ({crd[key]!r}), not in the model")
            elif key not in crd:
                found.append(f"{path}.{key}: in the model ({model[key]!r}), not in the CRD")
            else:
                found += differences(crd[key], model[key], f"{path}.{key}")
        return found
    if isinstance(crd, list) and isinstance(model, list) and len(crd) == len(model):
        return [
            d
            for i, (c, m) in enumerate(zip(crd, model, strict=True))
            for d in differences(c, m, f"{path}[{i}]")
        ]
    same = crd == model and type(crd) is type(model) or (isinstance(crd, int | float) and crd == model)
    return [] if same else [f"{path}: CRD {crd!r}, model {model!r}"]


@pytest.mark.parametrize(
    ("plural", "model"),
    [("inferenceservices", InferenceServiceSpec), ("tenantquotas", TenantQuotaSpec)],
)
def test_every_field_type_default_enum_and_bound_of_the_crd_is_the_model_s_and_back(
    plural: str, model: type[BaseModel]
) -> None:
    assert differences(canonical(crd_spec_schema(plural), {}), model_schema(model)) == []


def test_the_comparison_sees_a_changed_bound_a_missing_field_and_an_extra_one() -> None:
    crd = canonical(crd_spec_schema("tenantquotas"), {})
    model = model_schema(TenantQuotaSpec)
    model["properties"]["weight"]["maximum"] = 999
    del model["properties"]["priority"]
    model["properties"]["extra"] = {"type": "string"}
    assert differences(crd, model) == [
        "spec.properties.extra: in the model ({'type': 'string'}), not in the CRD",
        "spec.properties.priority: in the CRD ({'type': 'integer', 'default': 0, 'minimum': 0, 'maximum': 1000}), "
        "not in the model",
        "spec.properties.weight.maximum: CRD 1000, model 999",
    ]


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [(EngineSpec, "gpuMemoryUtilization", 0.0), (EngineSpec, "gpuMemoryUtilization", 1.5)],
)
def test_a_bound_the_crd_states_in_cel_is_the_model_s_validator(
    model: type[BaseModel], field: str, value: float
) -> None:
    with pytest.raises(ValidationError, match=r"must be in \(0, 1\]"):
        model.model_validate({field: value})


def test_target_kv_cache_usage_is_read_by_the_crd_s_name_and_bounded_as_its_cel_rule() -> None:
    assert (
        AutoscalingSpec.model_validate({"maxReplicas": 2, "targetKVCacheUsage": 0.5}).target_kv_cache_usage
        == 0.5
    )
    with pytest.raises(ValidationError, match=r"must be in \(0, 1\]"):
        AutoscalingSpec.model_validate({"maxReplicas": 2, "targetKVCacheUsage": 1.2})
