"""The one object a router process shares between its routes and its background loops.

It holds the validated config, the tenant table, the quota store, the fleet (engines,
picker, prefix index), one admission queue per model, the metrics and the HTTP clients
to the engines (httpx for the load poller, aiohttp on the proxy's hot path: its pool
stays cheap with hundreds of open connections, where httpx's is quadratic). ``build_app`` creates it; the routes reach it through a dependency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
import httpx

from kvfleet.router.admission import AdmissionQueue, QueueSlots
from kvfleet.router.config import RouterConfig
from kvfleet.router.discovery import Discovery
from kvfleet.router.fleet import Fleet, Placement
from kvfleet.router.metrics import RouterMetrics
from kvfleet.router.quota import Clock, QuotaStore
from kvfleet.router.tenants import TenantRegistry

if TYPE_CHECKING:
    from kvfleet.router.autoscaler import Autoscaler
    from kvfleet.router.usage import UsageLog
    from kvfleet.tracing import Tracing


@dataclass
class RouterState:
    config: RouterConfig
    clock: Clock
    tenants: TenantRegistry
    quota: QuotaStore
    fleet: Fleet
    discovery: Discovery
    metrics: RouterMetrics
    client: httpx.AsyncClient  # the load poller's
    upstream: aiohttp.ClientSession  # the proxied requests'
    queues: dict[str, AdmissionQueue[Placement]] = field(default_factory=dict)
    autoscaler: Autoscaler | None = None
    queue_slots: QueueSlots | None = None  # shared maxQueuedRequests (the Redis store); None: per replica
    models_created: dict[str, int] = field(default_factory=dict)  # model -> when this router first listed it
    usage_log: UsageLog | None = None  # --usage-log: one JSON line per finished request
    tracing: Tracing | None = None  # the OTEL_* variables turned tracing on (kvfleet.tracing)

    def __post_init__(self) -> None:
        self.fleet.on_change = self.pump

    def queue(self, model: str) -> AdmissionQueue[Placement]:
        q = self.queues.get(model)
        if q is None:
            q = AdmissionQueue(
                max_len=self.config.max_queue_len,
                max_wait_s=self.config.max_queue_wait_s,
                release=self.fleet.release,
                slots=self.queue_slots,
            )
            self.queues[model] = q
        return q

    def pump(self, model: str) -> None:
        q = self.queues.get(model)
        if q is not None:
            q.pump()
            self.metrics.child(self.metrics.queue_depth, model).set(len(q))

    def waiting(self, model: str) -> int:
        q = self.queues.get(model)
        return 0 if q is None else len(q)
