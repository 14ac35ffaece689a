"""The autoscaler inside the router: queue depth and KV usage → replicas (docs/architecture.md §1, §6).

For each InferenceService with ``spec.autoscaling``, every ``autoscale_interval_s``
(and at once when a request waits for a model with no ready engine):

1. :func:`recommend` (pure): ``ratio = max(waiting per replica / targetQueueDepth,
   mean KV usage / targetKVCacheUsage)``; inside ``1 ± tolerance`` keep the current
   count, else ``ceil(current × ratio)``; from zero, one replica (or ``minReplicas``)
   as soon as a request waits; down to zero (``scaleToZero``) only with nothing
   waiting, running or in flight. Clamped to ``[minReplicas, maxReplicas]``.
2. :class:`Stabilizer`: a scale-up applies the lowest recommendation of the last
   ``scaleUpStabilizationSeconds``, a scale-down the highest of the last
   ``scaleDownStabilizationSeconds`` (Kubernetes HPA semantics), so one spike or one
   lull does not move the fleet.
3. The :class:`Scaler` writes the result.

``Scaler`` is the seam to whatever runs the engines::

    class Scaler(Protocol):
        async def current_replicas(self, service: Service) -> int: ...
        async def set_replicas(self, service: Service, replicas: int) -> None: ...

:class:`kvfleet.router.kube.KubernetesScaler` reads and writes the InferenceService
``/scale`` subresource; the local fleet supervisor (``kvfleet up``) implements it by
starting and stopping engine processes, and passes it to ``build_app(config, scaler=...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet.resources import AutoscalingSpec
from kvfleet.router.discovery import Service

log = logging.getLogger(__name__)


class Scaler(Protocol):
    async def current_replicas(self, service: Service) -> int: ...

    async def set_replicas(self, service: Service, replicas: int) -> None: ...


@dataclass(frozen=True)
class ScaleInputs:
    current: int
    waiting: int  # engines' waiting + the router's queue for the model
    kv_usage: float  # mean over ready engines
    busy: int  # running at the engines + in flight through the router


def bounds(spec: AutoscalingSpec) -> tuple[int, int]:
    low = 0 if spec.scale_to_zero else max(1, spec.min_replicas)
    return low, max(low, spec.max_replicas)


def recommend(spec: AutoscalingSpec, x: ScaleInputs) -> int:
    # Invariant: the result is within bounds(spec); it is 0 only with scaleToZero and no work at
    # all, and at least 1 whenever a request waits.
    low, high = bounds(spec)
    if x.current == 0:
        wanted = max(1, spec.min_replicas) if x.waiting > 0 else 0
        return min(high, max(low, wanted))
    if x.waiting == 0 and x.busy == 0 and spec.scale_to_zero:
        return low
    ratio = max(x.waiting / x.current / spec.target_queue_depth, x.kv_usage / spec.target_kv_cache_usage)
    if abs(ratio - 1.0) <= spec.tolerance:
        wanted = x.current
    else:
        wanted = max(1, math.ceil(x.current * ratio - 1e-9))
    return min(high, max(low, wanted))


@dataclass
class Stabilizer:
    """The recent recommendations of one service."""

    history: deque[tuple[float, int]] = field(default_factory=deque)

    def decide(self, spec: AutoscalingSpec, current: int, recommended: int, now: float) -> int:
        # Invariant: a scale-up never exceeds any recommendation of the up-window, a scale-down never
        # goes below any recommendation of the down-window; the current count never leaves bounds.
        self.history.append((now, recommended))
        horizon = max(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
        while self.history and self.history[0][0] < now - horizon:
            self.history.popleft()
        low, high = bounds(spec)
        if recommended > current:
            up = [r for t, r in self.history if t >= now - spec.scale_up_stabilization_seconds]
            target = max(current, min(up))
        elif recommended < current:
            down = [r for t, r in self.history if t >= now - spec.scale_down_stabilization_seconds]
            target = min(current, max(down))
        else:
            target = current
        if current == 0 and recommended > 0:
            target = recommended  # requests are held: no window delays scale from zero
        return min(high, max(low, target))


@dataclass(frozen=True)
class Decision:
    service: str
    current: int
    recommended: int
    desired: int


@dataclass
class Autoscaler:
    """Runs the decision for every autoscaled service and applies it through the scaler."""

    scaler: Scaler
    inputs: Callable[[Service, int], ScaleInputs]
    services: Callable[[], list[Service]]
    clock: Callable[[], float]
    interval_s: float = 5.0
    _stabilizers: dict[str, Stabilizer] = field(default_factory=dict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def poke(self) -> None:
        """A request waits with no engine ready: decide now rather than at the next tick."""
        self._wake.set()

    async def step(self) -> list[Decision]:
        decisions: list[Decision] = []
        for service in self.services():
            spec = service.autoscaling
            if spec is None:
                continue
            current = await self.scaler.current_replicas(service)
            rec = recommend(spec, self.inputs(service, current))
            stab = self._stabilizers.setdefault(service.key, Stabilizer())
            desired = stab.decide(spec, current, rec, self.clock())
            if desired != current:
                log.info("scaling %s from %d to %d replicas", service.key, current, desired)
                await self.scaler.set_replicas(service, desired)
            decisions.append(Decision(service.key, current, rec, desired))
        return decisions

    async def run_forever(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # a failed write is retried at the next tick
                log.exception("autoscaler step failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
