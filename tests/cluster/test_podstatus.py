"""The pod status the process node writes (kvfleet/cluster/podstatus.py): phases, conditions, the patch."""

from __future__ import annotations

from typing import Any

from kvfleet.cluster import podstatus
from kvfleet.cluster.podstatus import (
    ConditionClock,
    ContainerView,
    PodView,
    pod_phase,
    pod_status,
    status_patch,
)

RUNNING = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}


def exited(code: int) -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}


def view(
    containers: list[ContainerView],
    init: list[ContainerView] | None = None,
    init_done: bool = True,
    **kw: Any,
) -> PodView:
    pod = {"metadata": {"name": "p"}, "spec": kw.pop("spec", {}), "status": kw.pop("status", {})}
    return PodView(
        pod=pod,
        pod_ip="127.1.0.2",
        host_ip="127.0.0.1",
        start_time="t0",
        init=init or [],
        containers=containers,
        init_done=init_done,
        **kw,
    )


def c(
    state: dict[str, Any], ready: bool = False, last: dict[str, Any] | None = None, name: str = "c"
) -> ContainerView:
    return ContainerView(
        name=name, image="img", state=state, last_state=last or {}, started="running" in state, ready=ready
    )


def test_a_pod_is_pending_until_every_container_started_then_running() -> None:
    waiting = {"waiting": {"reason": "ContainerCreating"}}
    assert pod_phase(view([c(RUNNING), c(waiting, name="d")]), "Always") == "Pending"
    assert pod_phase(view([c(RUNNING), c(RUNNING, name="d")]), "Always") == "Running"
    assert pod_phase(view([c(RUNNING)], init_done=False), "Always") == "Pending"


def test_stopped_containers_end_the_pod_as_its_restart_policy_says() -> None:
    backoff = {"waiting": {"reason": "CrashLoopBackOff"}}
    assert pod_phase(view([c(backoff, last=exited(1))]), "Always") == "Running"
    assert pod_phase(view([c(exited(0)), c(exited(0), name="d")]), "Never") == "Succeeded"
    assert pod_phase(view([c(exited(0)), c(exited(2), name="d")]), "Never") == "Failed"
    assert pod_phase(view([c(exited(0)), c(backoff, last=exited(2), name="d")]), "OnFailure") == "Running"
    assert pod_phase(view([c(exited(0))]), "OnFailure") == "Succeeded"


def test_a_failed_init_container_fails_a_never_pod_and_a_deleted_pod_ends_terminal() -> None:
    assert (
        pod_phase(view([c({"waiting": {}})], init=[c(exited(1), name="i")], init_done=False), "Never")
        == "Failed"
    )
    assert (
        pod_phase(view([c({"waiting": {}})], init=[c(exited(1), name="i")], init_done=False), "Always")
        == "Pending"
    )
    assert pod_phase(view([c(exited(143))], final=True), "Always") == "Failed"
    assert pod_phase(view([c(exited(0))], final=True), "Always") == "Succeeded"


def test_ready_follows_every_container_and_the_readiness_gates(monkeypatch: Any) -> None:
    clock = ConditionClock()
    status = pod_status(view([c(RUNNING, ready=True), c(RUNNING, ready=False, name="d")]), "Always", clock)
    conditions = {x["type"]: x for x in status["conditions"]}
    assert [conditions[t]["status"] for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")] == [
        "True",
        "True",
        "False",
        "False",
    ]
    assert conditions["Ready"]["reason"] == "ContainersNotReady"
    gated = view([c(RUNNING, ready=True)], spec={"readinessGates": [{"conditionType": "x/y"}]})
    assert {x["type"]: x["status"] for x in pod_status(gated, "Always", clock)["conditions"]}[
        "Ready"
    ] == "False"
    gated.pod["status"] = {"conditions": [{"type": "x/y", "status": "True"}]}
    assert {x["type"]: x["status"] for x in pod_status(gated, "Always", clock)["conditions"]}[
        "Ready"
    ] == "True"


def test_a_condition_keeps_its_transition_time_until_its_status_flips(monkeypatch: Any) -> None:
    times = iter(["t1", "t2", "t3"])
    monkeypatch.setattr(podstatus, "now_rfc3339", lambda: next(times))
    clock = ConditionClock([{"type": "PodScheduled", "status": "True", "lastTransitionTime": "t-scheduler"}])
    assert clock.condition("PodScheduled", True)["lastTransitionTime"] == "t-scheduler"
    assert clock.condition("Ready", False)["lastTransitionTime"] == "t1"
    assert clock.condition("Ready", False)["lastTransitionTime"] == "t1"
    assert clock.condition("Ready", True)["lastTransitionTime"] == "t2"


def test_the_same_pod_state_makes_the_same_status_so_nothing_is_rewritten() -> None:
    clock = ConditionClock()
    first = pod_status(view([c(RUNNING, ready=True)]), "Always", clock)
    assert pod_status(view([c(RUNNING, ready=True)]), "Always", clock) == first
    assert first["podIPs"] == [{"ip": "127.1.0.2"}] and first["hostIP"] == "127.0.0.1"
    assert first["containerStatuses"][0]["imageID"] == "process://img"


def test_the_patch_nulls_the_state_a_container_left_so_running_never_lingers_next_to_terminated() -> None:
    status = pod_status(view([c(exited(1), last=exited(0))]), "Never", ConditionClock())
    patch = status_patch(status)["status"]["containerStatuses"][0]
    assert patch["state"] == {"waiting": None, "running": None, "terminated": exited(1)["terminated"]}
    assert patch["lastState"]["running"] is None
