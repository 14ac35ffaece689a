"""TenantQuota validation (docs/architecture.md §7): the Secret and key exist, the models are served.

Pure: the handler fetches the Secret and the InferenceServices of the namespace and
passes them in; a model a tenant names may be a served model or one of its LoRA adapters. The router reads TenantQuotas itself; the operator only says, through
the ``Valid`` condition, whether the router will be able to use one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .renderers import Obj
from .spec import SpecError, TenantQuotaSpec
from .status import Condition


@dataclass(frozen=True)
class QuotaVerdict:
    condition: Condition
    retry: str | None = None  # set when a later Secret or InferenceService could make it valid


def _invalid(reason: str, message: str, retry: bool) -> QuotaVerdict:
    return QuotaVerdict(Condition("Valid", "False", reason, message), message if retry else None)


def served_names(inferenceservices: list[Obj]) -> set[str]:
    """What a TenantQuota's ``spec.models`` may name: each InferenceService's model and its adapters."""
    names: set[str] = set()
    for isvc in inferenceservices:
        spec = isvc.get("spec") or {}
        names.add(str((spec.get("model") or {}).get("name", "")))
        names |= {str(a.get("name", "")) for a in spec.get("adapters") or [] if isinstance(a, dict)}
    return names - {""}


def validate_tenantquota(
    spec: TenantQuotaSpec | None,
    secret: Obj | None,
    served_models: set[str],
    spec_error: SpecError | None = None,
) -> QuotaVerdict:
    """The Valid condition; references that may appear later are retried, spec errors are not."""
    if spec is None:
        return _invalid("InvalidSpec", str(spec_error), retry=False)
    ref = spec.api_key_secret_ref
    if secret is None:
        return _invalid("SecretNotFound", f"spec.apiKeySecretRef: Secret {ref.name!r} not found", retry=True)
    if not (secret.get("data") or {}).get(ref.key):
        return _invalid(
            "SecretKeyMissing",
            f"spec.apiKeySecretRef: Secret {ref.name!r} has no non-empty key {ref.key!r}",
            retry=True,
        )
    unknown = sorted(set(spec.models) - served_models)
    if unknown:
        served = ", ".join(sorted(served_models)) or "none"
        message = (
            f"spec.models: {', '.join(unknown)} not served by any InferenceService here (served: {served})"
        )
        return _invalid("UnknownModel", message, retry=True)
    scope = ", ".join(spec.models) if spec.models else "all models"
    return QuotaVerdict(Condition("Valid", "True", "Validated", f"tenant {spec.tenant!r}: {scope}"))
