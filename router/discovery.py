"""Where the engines are: the fleet's shape, as the router's poller reads it (docs/architecture.md §6, §7).

A :class:`Discovery` answers "which engine URLs exist, which InferenceService
each belongs to, and which kind of engine each is" (``kvfleet`` or ``vllm``:
:mod:`kvfleet.router.engine_kinds`). Three implementations: :class:`StaticDiscovery` (``--engines``, or
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
    engine_kind: str | None = None  # spec.engine.kind; None: kvfleet
    replicas: int | None = None  # spec.replicas: engines are expected (a rollout's gap is waited out)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Endpoint:
    """One engine's base URL, the service (key) it belongs to if known, and its kind if it says."""

    url: str
    service: str | None = None
    kind: str | None = None  # None: its service's ``engine_kind``, else ``kvfleet``


@dataclass(frozen=True)
class FleetView:
    endpoints: tuple[Endpoint, ...]
    services: tuple[Service, ...] = ()


class Discovery(Protocol):
    async def view(self) -> FleetView: ...

    async def close(self) -> None: ...


def static_endpoint(entry: str, default_kind: str | None = None) -> Endpoint:
    """One ``--engines`` entry, ``[KIND=]URL`` (``vllm=http://10.0.0.7:8000``); the kind is checked by
    :func:`kvfleet.router.config.engine_entry`, which every entry passed."""
    kind, sep, url = entry.partition("=")
    if not sep or "://" in kind:
        return Endpoint(entry.rstrip("/"), kind=default_kind)
    return Endpoint(url.rstrip("/"), kind=kind)


class StaticDiscovery:
    """A list of engine URLs (``[KIND=]URL`` entries), optionally with services; replaceable while running."""

    def __init__(
        self,
        urls: list[str] | None = None,
        services: tuple[Service, ...] = (),
        default_kind: str | None = None,
    ) -> None:
        endpoints = tuple(static_endpoint(u, default_kind) for u in urls or [])
        self._view = FleetView(endpoints, services)

    def set_engines(self, endpoints: list[Endpoint], services: tuple[Service, ...] | None = None) -> None:
        self._view = FleetView(tuple(endpoints), self._view.services if services is None else services)

    async def view(self) -> FleetView:
        return self._view

    async def close(self) -> None:
        return None
