"""Where the engines are: the fleet's shape, as the router's poller reads it (docs/architecture.md §6, §7).

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

from kvfleet.resources import AutoscalingSpec, SLOSpec


@dataclass(frozen=True)
class Service:
    """An InferenceService as the router uses it."""

    name: str
    model: str
    namespace: str = "default"
    policy: str | None = None
    slo: SLOSpec = field(default_factory=SLOSpec)
    autoscaling: AutoscalingSpec | None = None
    shared_prefix_cache: bool | None = None  # spec.routing.sharedPrefixCache; None: the router's flag

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
