"""The autoscaler, table-tested: ratio and tolerance, bounds, stabilisation windows, scale from and to zero."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.resources import AutoscalingSpec
from kvfleet.router.autoscaler import Autoscaler, ScaleInputs, Stabilizer, recommend
from kvfleet.router.discovery import Service

SPEC = AutoscalingSpec(
    minReplicas=1, maxReplicas=10, targetQueueDepth=4, targetKVCacheUsage=0.8, tolerance=0.1
)
ZERO = SPEC.model_copy(update={"scale_to_zero": True, "min_replicas": 0})


def case(
    spec: AutoscalingSpec, current: int, waiting: int, kv_usage: float, busy: int, expected: int, why: str
) -> Any:
    """One row of the table: the spec, the ScaleInputs field by field, the replicas expected and why."""
    inputs = ScaleInputs(current=current, waiting=waiting, kv_usage=kv_usage, busy=busy)
    return pytest.param(spec, inputs, expected, why, id=why)


# case(spec, current, waiting, kv_usage, busy, expected replicas, why): ratio and tolerance, bounds
BOUNDED = [
    case(SPEC, 2, 8, 0.4, 4, 2, "8/2/4 = 1.0: on target"),
    case(SPEC, 4, 17, 0.4, 8, 4, "1.0625: inside the 10% tolerance"),
    case(SPEC, 2, 10, 0.4, 4, 3, "1.25: ceil(2*1.25)=3"),
    case(SPEC, 2, 0, 0.96, 4, 3, "kv 0.96/0.8 = 1.2: ceil(2.4)=3"),
    case(SPEC, 4, 2, 0.2, 2, 1, "max(0.125, 0.25): ceil(1.0)=1"),
    case(SPEC, 3, 200, 0.9, 9, 10, "clamped to maxReplicas"),
    case(SPEC, 2, 0, 0.0, 0, 1, "idle, not below minReplicas"),
    case(SPEC, 0, 3, 0.0, 0, 1, "from zero when a request waits"),
]
# with scale to zero: from and to zero replicas
TO_ZERO = [
    case(ZERO, 0, 0, 0.0, 0, 0, "stays at zero with nothing waiting"),
    case(ZERO, 0, 50, 0.0, 0, 1, "from zero: one replica first"),
    case(ZERO, 2, 0, 0.0, 0, 0, "to zero with no work at all"),
    case(ZERO, 2, 0, 0.01, 1, 1, "not to zero while one runs"),
]


@pytest.mark.parametrize(("spec", "inputs", "expected", "why"), BOUNDED + TO_ZERO)
def test_the_recommendation(spec: AutoscalingSpec, inputs: ScaleInputs, expected: int, why: str) -> None:
    assert recommend(spec, inputs) == expected, why


def test_scales_down_only_after_the_stabilisation_window() -> None:
    spec = SPEC.model_copy(update={"scale_down_stabilization_seconds": 60})
    stab = Stabilizer()
    assert stab.decide(spec, current=4, recommended=4, now=0.0) == 4
    assert stab.decide(spec, current=4, recommended=1, now=10.0) == 4, "4 was recommended 10 s ago"
    assert stab.decide(spec, current=4, recommended=2, now=59.0) == 4
    assert stab.decide(spec, current=4, recommended=1, now=61.0) == 2, "highest of the last 60 s"
    assert stab.decide(spec, current=2, recommended=1, now=120.0) == 1


def test_scales_up_at_once_by_default_and_after_the_window_when_one_is_set() -> None:
    assert Stabilizer().decide(SPEC, current=1, recommended=5, now=0.0) == 5
    spec = SPEC.model_copy(update={"scale_up_stabilization_seconds": 30})
    stab = Stabilizer()
    assert stab.decide(spec, current=1, recommended=1, now=0.0) == 1
    assert stab.decide(spec, current=1, recommended=5, now=10.0) == 1, "the lowest of the last 30 s is 1"
    assert stab.decide(spec, current=1, recommended=5, now=31.0) == 5


def test_scale_from_zero_is_never_delayed_by_a_window() -> None:
    spec = ZERO.model_copy(update={"scale_up_stabilization_seconds": 300})
    stab = Stabilizer()
    assert stab.decide(spec, current=0, recommended=0, now=0.0) == 0
    assert stab.decide(spec, current=0, recommended=1, now=1.0) == 1


class RecordingScaler:
    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = replicas
        self.writes: list[tuple[str, int]] = []

    async def current_replicas(self, service: Service) -> int:
        return self.replicas[service.name]

    async def set_replicas(self, service: Service, replicas: int) -> None:
        self.writes.append((service.name, replicas))
        self.replicas[service.name] = replicas


async def test_a_step_writes_only_changed_counts_of_autoscaled_services(clock) -> None:
    services = [
        Service("a", "ma", autoscaling=SPEC),
        Service("b", "mb", autoscaling=SPEC),
        Service("c", "mc"),
    ]
    loads = {"a": ScaleInputs(2, 10, 0.5, 4), "b": ScaleInputs(2, 8, 0.5, 4)}
    scaler = RecordingScaler({"a": 2, "b": 2, "c": 1})
    auto = Autoscaler(scaler, lambda s, cur: loads[s.name], lambda: services, clock)
    decisions = await auto.step()
    assert scaler.writes == [("a", 3)]
    assert [(d.service, d.current, d.recommended, d.desired) for d in decisions] == [
        ("default/a", 2, 3, 3),
        ("default/b", 2, 2, 2),
    ]
