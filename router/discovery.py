"""Where the engines are: the fleet's shape, as the router's poller reads it (DESIGN §6, §7).

A :class:`Discovery` answers "which engine URLs exist, and which InferenceService
each belongs to". Three implementations: :class:`StaticDiscovery` (``--engines``, or
a local supervisor that calls :meth:`StaticDiscovery.set_engines` as it starts and
stops engines), and :class:`kvfleet.router.kube.KubernetesDiscovery` (InferenceServices
and their pods by label). The router polls each engine's ``/load`` itself; discovery
never says whether an engine is healthy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvfleet.router.config import SLO


class AutoscalingSpec(BaseModel):
    """``spec.autoscaling`` of an InferenceService (DESIGN §7)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    min_replicas: int = Field(default=1, alias="minReplicas", ge=0)
    max_replicas: int = Field(default=1, alias="maxReplicas", ge=0)
    target_queue_depth: float = Field(default=4.0, alias="targetQueueDepth", gt=0)
    target_kv_cache_usage: float = Field(default=0.8, alias="targetKVCacheUsage", gt=0, le=1)
    scale_up_stabilization_s: float = Field(default=0.0, alias="scaleUpStabilizationSeconds", ge=0)
    scale_down_stabilization_s: float = Field(default=300.0, alias="scaleDownStabilizationSeconds", ge=0)
    tolerance: float = Field(default=0.1, ge=0)
    scale_to_zero: bool = Field(default=False, alias="scaleToZero")


@dataclass(frozen=True)
class Service:
    """An InferenceService as the router uses it."""

    name: str
    model: str
    namespace: str = "default"
    policy: str | None = None
    slo: SLO = field(default_factory=SLO)
    autoscaling: AutoscalingSpec | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Endpoint:
    """One engine's base URL, and the service (key) it belongs to if known."""

    url: str
    service: str | None = None


@dataclass(frozen=True)
class FleetView:
    endpoints: tuple[Endpoint, ...]
    services: tuple[Service, ...] = ()


class Discovery(Protocol):
    async def view(self) -> FleetView: ...

    async def close(self) -> None: ...


class StaticDiscovery:
    """A list of engine URLs, optionally with services; replaceable while running."""

    def __init__(self, urls: list[str] | None = None, services: tuple[Service, ...] = ()) -> None:
        self._view = FleetView(tuple(Endpoint(u.rstrip("/")) for u in urls or []), services)

    def set_engines(self, endpoints: list[Endpoint], services: tuple[Service, ...] | None = None) -> None:
        self._view = FleetView(tuple(endpoints), self._view.services if services is None else services)

    async def view(self) -> FleetView:
        return self._view

    async def close(self) -> None:
        return None
