"""Status, drift and TenantQuota decisions: pure functions on plain dicts."""

from __future__ import annotations

from typing import Any

from kvfleet.operator import children
from kvfleet.operator.spec import parse_tenantquota
from kvfleet.operator.status import Blocker, CapacityVerdict, Observed, compute_status, status_patch
from kvfleet.operator.tenantquota import served_names, validate_tenantquota

UNKNOWN = CapacityVerdict("Unknown", "NoGPUType", "spec.resources.gpuType is not set: capacity not checked")
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def deployment(replicas: int, ready: int, updated: int | None = None, **extra: Any) -> dict[str, Any]:
    status = {
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": ready if updated is None else updated,
    }
    status.update(observedGeneration=2, **extra)
    return {"metadata": {"generation": 2}, "status": status}


def observed(replicas: int = 2, dep: dict[str, Any] | None = None, **kw: Any) -> Observed:
    return Observed(
        generation=7,
        replicas=replicas,
        selector="a=b",
        endpoint="http://x",
        capacity=UNKNOWN,
        deployment=dep,
        **kw,
    )


def kinds(status: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(c["type"], c["status"], c["reason"]) for c in status["conditions"]]


def test_a_fully_rolled_out_deployment_is_ready_and_done() -> None:
    status = compute_status(observed(dep=deployment(2, 2)), {}, T0)
    assert kinds(status) == [
        ("Ready", "True", "EnginesReady"),
        ("Progressing", "False", "RolloutComplete"),
        ("Degraded", "False", "AsExpected"),
        ("CapacityFits", "Unknown", "NoGPUType"),
    ]
    assert (status["replicas"], status["readyReplicas"], status["observedGeneration"]) == (2, 2, 7)
    assert {c["observedGeneration"] for c in status["conditions"]} == {7}


def test_a_rollout_in_flight_is_progressing_and_not_ready() -> None:
    status = compute_status(observed(dep=deployment(3, 1, updated=2)), {}, T0)
    assert kinds(status)[:2] == [("Ready", "False", "EnginesNotReady"), ("Progressing", "True", "RollingOut")]
    assert status["conditions"][0]["message"] == "1/2 engine pods ready"


def test_a_stalled_rollout_and_replica_failures_are_degraded() -> None:
    stalled = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": "too slow",
    }
    status = compute_status(observed(dep=deployment(2, 1, conditions=[stalled])), {}, T0)
    assert kinds(status)[1:3] == [
        ("Progressing", "False", "ProgressDeadlineExceeded"),
        ("Degraded", "True", "ProgressDeadlineExceeded"),
    ]
    failure = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "quota"}
    assert kinds(compute_status(observed(dep=deployment(2, 1, conditions=[failure])), {}, T0))[2] == (
        "Degraded",
        "True",
        "ReplicaFailure",
    )


def test_a_blocker_degrades_and_blocks_the_rollout_while_the_old_engines_serve() -> None:
    blocker = Blocker("PVCNotFound", "PersistentVolumeClaim 'w' not found")
    status = compute_status(observed(dep=deployment(2, 2), blockers=[blocker]), {}, T0)
    assert kinds(status)[:3] == [
        ("Ready", "True", "EnginesReady"),
        ("Progressing", "False", "RolloutBlocked"),
        ("Degraded", "True", "PVCNotFound"),
    ]
    assert kinds(compute_status(observed(blockers=[blocker]), {}, T0))[0] == ("Ready", "False", "PVCNotFound")


def test_zero_replicas_is_scaled_to_zero() -> None:
    assert kinds(compute_status(observed(replicas=0, dep=deployment(0, 0)), {}, T0))[0] == (
        "Ready",
        "False",
        "ScaledToZero",
    )


def test_a_condition_keeps_its_transition_time_until_its_status_flips() -> None:
    first = compute_status(observed(dep=deployment(2, 2)), {}, T0)
    same = compute_status(observed(dep=deployment(2, 2)), first, T1)
    assert same == first and status_patch(same, first) is None
    flipped = compute_status(observed(dep=deployment(2, 1)), first, T1)
    times = {c["type"]: c["lastTransitionTime"] for c in flipped["conditions"]}
    assert times == {"Ready": T1, "Progressing": T1, "Degraded": T0, "CapacityFits": T0}
    assert status_patch(flipped, first) == {"readyReplicas": 1, "conditions": flipped["conditions"]}


def test_a_status_patch_removes_figures_the_operator_no_longer_writes() -> None:
    old = {"capacity": {"kvTokens": 5}, "replicas": 1}
    assert status_patch({"replicas": 1}, old) == {"capacity": None}


def test_drift_is_what_was_rendered_missing_or_different_never_server_defaults() -> None:
    desired = {
        "metadata": {"labels": {"a": "1"}},
        "spec": {"replicas": 2, "template": {"ports": [{"port": 80}]}},
    }
    defaulted = {
        "metadata": {"labels": {"a": "1", "other": "x"}, "uid": "u"},
        "spec": {
            "replicas": 2,
            "template": {"ports": [{"port": 80, "protocol": "TCP"}]},
            "revisionHistoryLimit": 10,
        },
        "status": {"replicas": 2},
    }
    assert children.drift_patch(desired, defaulted) == []
    changed = {
        **defaulted,
        "spec": {**defaulted["spec"], "replicas": 3},
        "metadata": {"labels": {"a/b": "2"}},
    }
    assert children.drift_patch(desired, changed) == [
        {"op": "add", "path": "/metadata/labels/a", "value": "1"},
        {"op": "add", "path": "/spec", "value": desired["spec"]},
    ]
    assert children.drift_patch(
        {"metadata": {"labels": {"x/y": "1"}}}, {"metadata": {"labels": {"z": "2"}}}
    ) == [{"op": "add", "path": "/metadata/labels/x~1y", "value": "1"}]


def tq_spec(**fields: Any) -> Any:
    return parse_tenantquota({"tenant": "acme", "apiKeySecretRef": {"name": "acme-key"}, **fields})


def test_a_tenantquota_is_valid_only_with_its_secret_key_and_served_models() -> None:
    secret = {"data": {"api-key": "c2stYWNtZQ=="}}
    assert validate_tenantquota(tq_spec(), None, set()).condition.reason == "SecretNotFound"
    assert (
        validate_tenantquota(tq_spec(), {"data": {"other": "eA=="}}, set()).condition.reason
        == "SecretKeyMissing"
    )
    unknown = validate_tenantquota(tq_spec(models=["a", "b"]), secret, {"a"})
    assert (unknown.condition.status, unknown.condition.reason) == ("False", "UnknownModel")
    assert unknown.condition.message == "spec.models: b not served by any InferenceService here (served: a)"
    assert unknown.retry == unknown.condition.message
    valid = validate_tenantquota(tq_spec(models=["a"]), secret, {"a"})
    assert (valid.condition.status, valid.condition.reason, valid.retry) == ("True", "Validated", None)


def test_the_status_lists_the_adapters_and_a_patch_removes_them_once_gone() -> None:
    status = compute_status(observed(adapters=["sql", "chat"]), {}, T0)
    assert status["adapters"] == ["sql", "chat"]
    without = compute_status(observed(), status, T0)
    assert "adapters" not in without
    assert (status_patch(without, status) or {})["adapters"] is None


def test_a_tenantquota_may_name_the_adapters_of_an_inferenceservice_as_models() -> None:
    isvcs = [
        {"spec": {"model": {"name": "llama"}, "adapters": [{"name": "sql", "uri": "pvc://l/sql"}]}},
        {"spec": {"model": {"name": "qwen"}}},
    ]
    served = served_names(isvcs)
    assert served == {"llama", "sql", "qwen"}
    secret = {"data": {"api-key": "c2stYQ=="}}
    assert validate_tenantquota(tq_spec(models=["llama", "sql"]), secret, served).condition.status == "True"
    assert validate_tenantquota(tq_spec(models=["chat"]), secret, served).condition.reason == "UnknownModel"
