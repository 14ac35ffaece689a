"""InferenceService status from what the operator saw (docs/architecture.md §7): pure functions.

Inputs are the spec verdicts (the spec error, the blockers found while checking it,
the capacity verdict) and the engine Deployment as the API server reports it; the
output is the whole ``status`` dict. The handlers write it only when it differs from
the stored one, so a resync with nothing changed writes nothing: every field here is a
function of its inputs, and a condition keeps its ``lastTransitionTime`` while its
status stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .renderers import Obj

CondStatus = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Condition:
    type: str
    status: CondStatus
    reason: str
    message: str = ""


@dataclass(frozen=True)
class CapacityVerdict:
    """What the capacity maths says about the spec on its GPUs; ``figures`` go to status.capacity."""

    status: CondStatus
    reason: str
    message: str
    figures: dict[str, Any] | None = None


@dataclass(frozen=True)
class Blocker:
    """Why the spec cannot run as written; the operator does not roll it out while one exists."""

    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    """Everything the status is computed from."""

    generation: int | None
    replicas: int
    selector: str
    endpoint: str
    capacity: CapacityVerdict
    blockers: list[Blocker] = field(default_factory=list)
    deployment: Obj | None = None
    adapters: list[str] = field(default_factory=list)  # names of spec.adapters the pods are given


def _deployment_condition(dep: Obj, kind: str) -> Obj | None:
    for cond in dep.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def _rollout_done(dep: Obj, replicas: int) -> bool:
    st = dep.get("status", {}) or {}
    generation = dep.get("metadata", {}).get("generation")
    seen = st.get("observedGeneration")
    current = generation is None or (seen is not None and seen >= generation)
    return bool(
        current
        and st.get("updatedReplicas", 0) >= replicas
        and st.get("readyReplicas", 0) >= replicas
        and st.get("replicas", 0) <= replicas
    )


def ready_condition(obs: Observed) -> Condition:
    dep = obs.deployment
    if dep is None:
        reason = obs.blockers[0].reason if obs.blockers else "DeploymentNotCreated"
        return Condition("Ready", "False", reason, "the engine Deployment does not exist")
    ready = (dep.get("status", {}) or {}).get("readyReplicas", 0) or 0
    if obs.replicas == 0:
        return Condition("Ready", "False", "ScaledToZero", "spec.replicas is 0")
    if ready >= obs.replicas:
        return Condition("Ready", "True", "EnginesReady", f"{ready}/{obs.replicas} engine pods ready")
    return Condition("Ready", "False", "EnginesNotReady", f"{ready}/{obs.replicas} engine pods ready")


def progressing_condition(obs: Observed) -> Condition:
    if obs.blockers:
        return Condition("Progressing", "False", "RolloutBlocked", obs.blockers[0].message)
    dep = obs.deployment
    if dep is None:
        return Condition("Progressing", "True", "Creating", "creating the engine Deployment")
    stalled = _deployment_condition(dep, "Progressing")
    if stalled is not None and stalled.get("reason") == "ProgressDeadlineExceeded":
        return Condition("Progressing", "False", "ProgressDeadlineExceeded", str(stalled.get("message", "")))
    if _rollout_done(dep, obs.replicas):
        return Condition("Progressing", "False", "RolloutComplete", f"{obs.replicas} engine pods up to date")
    return Condition("Progressing", "True", "RollingOut", "the engine Deployment is rolling out")


def degraded_condition(obs: Observed) -> Condition:
    if obs.blockers:
        return Condition("Degraded", "True", obs.blockers[0].reason, obs.blockers[0].message)
    dep = obs.deployment or {}
    failure = _deployment_condition(dep, "ReplicaFailure")
    if failure is not None and failure.get("status") == "True":
        return Condition("Degraded", "True", "ReplicaFailure", str(failure.get("message", "")))
    stalled = _deployment_condition(dep, "Progressing")
    if stalled is not None and stalled.get("reason") == "ProgressDeadlineExceeded":
        return Condition("Degraded", "True", "ProgressDeadlineExceeded", str(stalled.get("message", "")))
    return Condition("Degraded", "False", "AsExpected", "")


def capacity_condition(obs: Observed) -> Condition:
    cap = obs.capacity
    return Condition("CapacityFits", cap.status, cap.reason, cap.message)


def conditions_as_dicts(new: list[Condition], old: list[Obj], now: str, generation: int | None) -> list[Obj]:
    """Conditions in API form; each keeps its old ``lastTransitionTime`` unless its status flipped."""
    previous = {c.get("type"): c for c in old}
    out: list[Obj] = []
    for cond in new:
        prev = previous.get(cond.type)
        since = prev.get("lastTransitionTime") if prev and prev.get("status") == cond.status else None
        item: Obj = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": since or now,
        }
        if generation is not None:
            item["observedGeneration"] = generation
        out.append(item)
    return out


def compute_status(obs: Observed, old_status: Obj, now: str) -> Obj:
    """The whole ``status`` of an InferenceService (``now`` only stamps conditions that flip)."""
    dep_status = (obs.deployment or {}).get("status", {}) or {}
    conditions = [
        ready_condition(obs),
        progressing_condition(obs),
        degraded_condition(obs),
        capacity_condition(obs),
    ]
    status: Obj = {
        "replicas": int(dep_status.get("replicas", 0) or 0),
        "readyReplicas": int(dep_status.get("readyReplicas", 0) or 0),
        "selector": obs.selector,
        "endpoint": obs.endpoint,
        "conditions": conditions_as_dicts(
            conditions, list(old_status.get("conditions", []) or []), now, obs.generation
        ),
    }
    if obs.adapters:
        status["adapters"] = list(obs.adapters)
    if obs.capacity.figures is not None:
        status["capacity"] = obs.capacity.figures
    if obs.generation is not None:
        status["observedGeneration"] = obs.generation
    return status


def status_patch(new: Obj, old: Obj) -> Obj | None:
    """A merge patch from ``old`` to ``new`` status, or None when nothing changed.

    Keys the operator no longer writes (e.g. ``capacity`` once the GPU type is removed)
    are nulled so the merge patch removes them."""
    ours = {
        "replicas",
        "readyReplicas",
        "selector",
        "endpoint",
        "conditions",
        "capacity",
        "observedGeneration",
        "adapters",
    }
    patch: Obj = {k: v for k, v in new.items() if old.get(k) != v}
    for key in ours - set(new):
        if key in old:
            patch[key] = None
    return patch or None
