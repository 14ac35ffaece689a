"""A pod's status from what the process node knows of its containers (issue #43): pure, no I/O.

Where it sits: :mod:`kvfleet.cluster.podworker` snapshots each container as a
:class:`ContainerView` on every tick and calls :func:`pod_status`; it writes the result only
when it differs from what it wrote last (a quiet pod costs no API write per probe tick), as a
strategic merge patch made by :func:`status_patch`: conditions merge by type (another
controller's conditions and readiness gates stay), container statuses by name, and the state keys
a container left are sent as nulls so a ``running`` never lingers next to a ``terminated``.
Phases and conditions follow the kubelet's rules (pkg/kubelet/kubelet_pods.go ``getPhase``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]
OWN_CONDITIONS = ("PodScheduled", "Initialized", "ContainersReady", "Ready")
_STATE_KEYS = ("waiting", "running", "terminated")


def now_rfc3339() -> str:
    """A ``metav1.Time``: whole seconds, UTC."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def now_micro() -> str:
    """A ``metav1.MicroTime`` (a Lease's renewTime)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def exit_code(state: Obj) -> int | None:
    """The exit code of a ``{"terminated": ...}`` state, else None."""
    terminated = state.get("terminated")
    return None if terminated is None else int(terminated.get("exitCode", 0))


@dataclass
class ContainerView:
    """One container as the status shows it."""

    name: str
    image: str
    state: Obj
    last_state: Obj = field(default_factory=dict)
    restart_count: int = 0
    started: bool = False
    ready: bool = False
    container_id: str | None = None

    def as_status(self) -> Obj:
        out: Obj = {
            "name": self.name,
            "image": self.image,
            "imageID": f"process://{self.image}",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.container_id:
            out["containerID"] = self.container_id
        return out


@dataclass
class PodView:
    """Everything the status is made of: the pod as last seen, its addresses and its containers."""

    pod: Obj
    pod_ip: str
    host_ip: str
    start_time: str
    init: list[ContainerView]
    containers: list[ContainerView]
    init_done: bool
    final: bool = False  # after a deletion stopped every process: a terminal phase whatever the policy
    sidecars: frozenset[str] = frozenset()  # init containers with restartPolicy Always: run alongside


def pod_phase(view: PodView, policy: str) -> str:
    """Pending until the init containers are done and every container has started once; then
    Running, or Succeeded/Failed once all stopped for good (kubelet ``getPhase``)."""
    if not view.init_done:
        failed = any(exit_code(c.state) not in (None, 0) for c in view.init if c.name not in view.sidecars)
        if view.final or (failed and policy == "Never"):
            return "Failed"
        return "Pending"
    regular = view.containers
    codes = [exit_code(c.state) if "terminated" in c.state else exit_code(c.last_state) for c in regular]
    if view.final:
        return "Succeeded" if all(code == 0 for code in codes) else "Failed"
    if any("waiting" in c.state and not c.last_state for c in regular):
        return "Pending"
    if any("running" in c.state for c in regular) or policy == "Always":
        return "Running"
    if all(code == 0 for code in codes):
        return "Succeeded"
    return "Failed" if policy == "Never" else "Running"


class ConditionClock:
    """Each condition's lastTransitionTime: kept while its status stays, now when it flips."""

    def __init__(self, existing: list[Obj] | None = None) -> None:
        self._seen: dict[str, tuple[str, str]] = {
            c["type"]: (c.get("status", ""), c.get("lastTransitionTime") or now_rfc3339())
            for c in existing or []
            if "type" in c
        }

    def condition(self, kind: str, ok: bool, reason: str | None = None) -> Obj:
        status = "True" if ok else "False"
        seen = self._seen.get(kind)
        if seen is None or seen[0] != status:
            seen = self._seen[kind] = (status, now_rfc3339())
        out: Obj = {"type": kind, "status": status, "lastTransitionTime": seen[1]}
        if reason and not ok:
            out["reason"] = reason
        return out


def _conditions(view: PodView, phase: str, clock: ConditionClock) -> list[Obj]:
    existing = {c.get("type"): c for c in (view.pod.get("status") or {}).get("conditions") or []}
    gates = [g.get("conditionType") for g in (view.pod.get("spec") or {}).get("readinessGates") or []]
    done = phase in ("Succeeded", "Failed")
    running = view.containers + [c for c in view.init if c.name in view.sidecars]
    ready = view.init_done and not done and bool(view.containers) and all(c.ready for c in running)
    gated = ready and all((existing.get(g) or {}).get("status") == "True" for g in gates)
    not_ready = "PodCompleted" if done else "ContainersNotReady"
    return [
        clock.condition("PodScheduled", True),
        clock.condition("Initialized", view.init_done, "ContainersNotInitialized"),
        clock.condition("ContainersReady", ready, not_ready),
        clock.condition("Ready", gated, "ReadinessGatesNotReady" if ready and not gated else not_ready),
    ]


def pod_status(view: PodView, policy: str, clock: ConditionClock) -> Obj:
    """The pod's ``status`` as the kubelet reports it (only the fields the kubelet owns)."""
    phase = pod_phase(view, policy)
    status: Obj = {
        "phase": phase,
        "hostIP": view.host_ip,
        "hostIPs": [{"ip": view.host_ip}],
        "podIP": view.pod_ip,
        "podIPs": [{"ip": view.pod_ip}],
        "startTime": view.start_time,
        "conditions": _conditions(view, phase, clock),
        "containerStatuses": [c.as_status() for c in view.containers],
    }
    init = [c.as_status() for c in view.init]
    if init:
        status["initContainerStatuses"] = init
    return status


def _with_nulls(state: Obj) -> Obj:
    return {key: state.get(key) for key in _STATE_KEYS}


def status_patch(status: Obj) -> Obj:
    """``status`` as a strategic merge patch of the pod: a state key a container left becomes null."""
    patch: Obj = {**status}
    for key in ("containerStatuses", "initContainerStatuses"):
        if key in status:
            patch[key] = [
                {**c, "state": _with_nulls(c["state"]), "lastState": _with_nulls(c["lastState"])}
                for c in status[key]
            ]
    return {"status": patch}
