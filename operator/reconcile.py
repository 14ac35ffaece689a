"""One reconciliation of an InferenceService or a TenantQuota: read, decide, write the difference.

The kopf handlers (``handlers.py``) call these with a :class:`~kvfleet.operator.kube.KubeApi`;
the decisions are the pure renderers, the status functions and the TenantQuota checks.
A spec that cannot run is never rolled out: it gets a Degraded (and, for capacity,
CapacityFits=False) condition and the last good Deployment keeps serving. What may fix
itself (a PVC or Secret created later, a conflict) is reported back as ``retry`` so the
handler asks kopf to come back with backoff.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from kvfleet.protocol import INFERENCESERVICE_PLURAL, TENANTQUOTA_PLURAL

from . import children, renderers
from .capacity_status import capacity_verdict
from .config import OperatorConfig
from .kube import KubeApi
from .renderers import Obj, Owner
from .spec import InferenceServiceSpec, SpecError, parse_inferenceservice, parse_tenantquota
from .status import Blocker, CapacityVerdict, Observed, compute_status, conditions_as_dicts, status_patch
from .tenantquota import served_names, validate_tenantquota

CHILD_KINDS = ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy")


@dataclass(frozen=True)
class Outcome:
    """What one reconciliation did: whether it wrote anything, and why it wants a retry (or None)."""

    wrote_children: bool
    wrote_status: bool
    retry: str | None = None
    warning: tuple[str, str] | None = None  # (reason, message) of a condition that just went bad


def _turned_bad(kind: str, bad: str, new: Obj, old: Obj) -> tuple[str, str] | None:
    """(reason, message) when condition ``kind`` has status ``bad`` now and did not before."""

    def find(status: Obj) -> Obj:
        return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})

    now, before = find(new), find(old)
    if now.get("status") == bad and before.get("status") != bad:
        return str(now.get("reason", "")), str(now.get("message", ""))
    return None


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_of(body: Any) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid", ""))


def _pvc_blockers(api: KubeApi, namespace: str, spec: InferenceServiceSpec) -> list[Blocker]:
    """A blocker for each PersistentVolumeClaim the model or an adapter names that is not there."""
    uris = [("spec.model.uri", spec.model.uri)]
    uris += [(f"spec.adapters[{i}].uri", a.uri) for i, a in enumerate(spec.adapters)]
    blockers: list[Blocker] = []
    for field, uri in uris:
        if not uri.startswith("pvc://"):
            continue
        name = uri[len("pvc://") :].split("/")[0]
        if not api.pvc_exists(namespace, name):
            message = f"{field} {uri!r}: PersistentVolumeClaim {name!r} not found in {namespace!r}"
            blockers.append(Blocker("PVCNotFound", message))
    return blockers


def _apply_children(
    api: KubeApi, owner: Owner, spec: InferenceServiceSpec, image: str, config: OperatorConfig
) -> tuple[Obj, bool]:
    """Create/patch every child; returns the Deployment as stored and whether anything was written."""
    wrote = False
    deployment: Obj = {}
    for desired in renderers.render_children(
        owner, spec, image, config.ingress_sources(), config.engine_shm_per_gpu
    ):
        if desired["kind"] == "Deployment":
            desired = renderers.with_engine_env(desired, config.engine_env())
        meta = desired["metadata"]
        existing = api.get(desired["kind"], meta["namespace"], meta["name"])
        if existing is not None and not children.owned_by(existing, owner.uid):
            raise children.NotOwnedError(desired["kind"], meta["name"])
        obj, changed = children.apply(api, desired)
        wrote = wrote or changed
        if desired["kind"] == "Deployment":
            deployment = obj
    return deployment, wrote


@dataclass(frozen=True)
class Judgement:
    """What the operator makes of a spec before touching anything."""

    spec: InferenceServiceSpec | None
    capacity: CapacityVerdict
    blockers: list[Blocker]
    retry: str | None = None


def judge(api: KubeApi, namespace: str, raw_spec: Obj) -> Judgement:
    """Parse the spec, run the capacity maths, check what it refers to; no writes."""
    try:
        spec = parse_inferenceservice(raw_spec)
    except SpecError as err:
        return Judgement(
            None, CapacityVerdict("Unknown", "InvalidSpec", str(err)), [Blocker("InvalidSpec", str(err))]
        )
    capacity, blockers = capacity_verdict(spec)
    missing = _pvc_blockers(api, namespace, spec)
    return Judgement(spec, capacity, blockers + missing, missing[0].message if missing else None)


def sync_inferenceservice(
    api: KubeApi, config: OperatorConfig, body: Any, *, apply_children: bool
) -> Outcome:
    """Bring the children (when ``apply_children``) and the status in line with the spec."""
    owner = owner_of(body)
    old_status: Obj = dict(body.get("status") or {})
    verdict = judge(api, owner.namespace, dict(body.get("spec") or {}))
    blockers, retry = verdict.blockers, verdict.retry
    wrote = False
    deployment: Obj | None = None
    if verdict.spec is not None and not blockers and apply_children:
        image = verdict.spec.engine.image or config.engine_image_for(
            verdict.spec.resources.gpus, verdict.spec.engine.kind
        )
        try:
            deployment, wrote = _apply_children(api, owner, verdict.spec, image, config)
        except children.NotOwnedError as err:
            blockers, retry = [Blocker("NameConflict", str(err))], str(err)
    if deployment is None:
        deployment = api.get("Deployment", owner.namespace, owner.name)
    observed = Observed(
        generation=body["metadata"].get("generation"),
        replicas=verdict.spec.replicas if verdict.spec is not None else 0,
        selector=renderers.selector_string(owner.name),
        endpoint=renderers.endpoint(owner),
        capacity=verdict.capacity,
        blockers=blockers,
        deployment=deployment,
        adapters=[a.name for a in verdict.spec.adapters] if verdict.spec is not None else [],
    )
    new_status = compute_status(observed, old_status, utcnow())
    patch = status_patch(new_status, old_status)
    if patch is not None:
        api.patch_status(INFERENCESERVICE_PLURAL, owner.namespace, owner.name, patch)
    warning = _turned_bad("Degraded", "True", new_status, old_status)
    return Outcome(wrote_children=wrote, wrote_status=patch is not None, retry=retry, warning=warning)


def delete_children(api: KubeApi, body: Any) -> list[str]:
    """Delete what this InferenceService owns (by uid), engines first; returns the kinds deleted."""
    owner = owner_of(body)
    deleted: list[str] = []
    for kind in CHILD_KINDS:
        obj = api.get(kind, owner.namespace, owner.name)
        if obj is not None and children.owned_by(obj, owner.uid):
            api.delete(kind, owner.namespace, owner.name)
            deleted.append(kind)
    return deleted


def sync_tenantquota(api: KubeApi, body: Any) -> Outcome:
    """Validate a TenantQuota against its Secret and the served models; write Valid when it changed."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    old_status: Obj = dict(body.get("status") or {})
    try:
        spec = parse_tenantquota(dict(body.get("spec") or {}))
    except SpecError as err:
        verdict = validate_tenantquota(None, None, set(), spec_error=err)
    else:
        secret = api.get_secret(namespace, spec.api_key_secret_ref.name)
        isvcs = api.list_custom(INFERENCESERVICE_PLURAL, namespace) if spec.models else []
        verdict = validate_tenantquota(spec, secret, served_names(isvcs))
    generation = meta.get("generation")
    new_status: Obj = {
        "conditions": conditions_as_dicts(
            [verdict.condition], old_status.get("conditions") or [], utcnow(), generation
        )
    }
    if generation is not None:
        new_status["observedGeneration"] = generation
    patch = {k: v for k, v in new_status.items() if old_status.get(k) != v} or None
    if patch is not None:
        api.patch_status(TENANTQUOTA_PLURAL, namespace, name, patch)
    warning = _turned_bad("Valid", "False", new_status, old_status)
    return Outcome(wrote_children=False, wrote_status=patch is not None, retry=verdict.retry, warning=warning)
