"""How the router reads an engine's load, by the engine's kind (docs/architecture.md §6, "Engine kinds").

Sits between the poller (:mod:`kvfleet.router.fleet`) and the engines: the poller asks the
:class:`LoadReader` of each engine's kind for its load and its LoRA adapters, and every
reader answers in the router's one load model, :class:`~kvfleet.protocol.EngineLoad`, so
picking, admission and autoscaling never know which kind served. Readers register by name
in :data:`KINDS` (the names are :data:`kvfleet.protocol.ENGINE_KINDS`):

* ``kvfleet``: ``GET /load`` (JSON, the engine's own contract, §5);
* ``vllm``: ``GET /metrics`` (Prometheus text, :func:`kvfleet.router.vllm_metrics.vllm_load`).

Both read the adapters from ``GET /v1/models`` (the cards with a ``parent``). A poll that
brings no load says why (:class:`PollMiss`): only a gone engine or a bad answer counts
against it; a slow one is skipped.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx
from pydantic import ValidationError

from kvfleet.protocol import DEFAULT_ENGINE_KIND, ENGINE_KINDS, EngineLoad
from kvfleet.router.vllm_metrics import vllm_load


class PollMiss(enum.Enum):
    """Why a load poll brought no load: only ``DOWN`` and ``BAD`` count against the engine."""

    DOWN = "down"  # connection refused or reset: the engine is gone
    BAD = "bad"  # it answered, but not with a load (an error status, invalid JSON or metrics)
    SLOW = "slow"  # no answer within load_timeout_s: busy, not broken


class LoadReader(Protocol):
    """One engine kind: how its load and its adapters are read."""

    @property
    def name(self) -> str: ...

    async def load(self, client: httpx.AsyncClient, url: str, timeout: float) -> EngineLoad | PollMiss: ...

    async def adapters(
        self, client: httpx.AsyncClient, url: str, timeout: float
    ) -> frozenset[str] | None: ...


async def read_page(
    client: httpx.AsyncClient, url: str, timeout: float, parse: Callable[[bytes], EngineLoad]
) -> EngineLoad | PollMiss:
    """GET ``url`` and ``parse`` the body, or why not (a timeout is ``SLOW``, never ``DOWN``)."""
    try:
        response = await client.get(url, timeout=timeout)
        response.raise_for_status()
        return parse(response.content)
    except httpx.TimeoutException:
        return PollMiss.SLOW
    except (httpx.TransportError, httpx.StreamError):
        return PollMiss.DOWN
    except (httpx.HTTPStatusError, ValidationError, ValueError):
        return PollMiss.BAD


async def fetch_adapters(client: httpx.AsyncClient, url: str, timeout: float) -> frozenset[str] | None:
    """The adapters an engine's ``GET /v1/models`` lists (cards with a ``parent``), or None if unread."""
    try:
        response = await client.get(f"{url}/v1/models", timeout=timeout)
        response.raise_for_status()
        cards = response.json().get("data") or []
        return frozenset(
            str(c["id"]) for c in cards if isinstance(c, dict) and c.get("parent") and c.get("id")
        )
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


async def fetch_load(client: httpx.AsyncClient, url: str, timeout: float) -> EngineLoad | PollMiss:
    """A kvfleet engine's ``/load``."""
    return await read_page(client, f"{url}/load", timeout, EngineLoad.model_validate_json)


@dataclass(frozen=True)
class KvfleetReader:
    name: str = "kvfleet"

    async def load(self, client: httpx.AsyncClient, url: str, timeout: float) -> EngineLoad | PollMiss:
        return await fetch_load(client, url, timeout)

    async def adapters(self, client: httpx.AsyncClient, url: str, timeout: float) -> frozenset[str] | None:
        return await fetch_adapters(client, url, timeout)


@dataclass(frozen=True)
class VllmReader:
    name: str = "vllm"

    async def load(self, client: httpx.AsyncClient, url: str, timeout: float) -> EngineLoad | PollMiss:
        return await read_page(client, f"{url}/metrics", timeout, lambda body: vllm_load(body.decode()))

    async def adapters(self, client: httpx.AsyncClient, url: str, timeout: float) -> frozenset[str] | None:
        return await fetch_adapters(client, url, timeout)


KINDS: dict[str, LoadReader] = {r.name: r for r in (KvfleetReader(), VllmReader())}
assert set(KINDS) == set(ENGINE_KINDS), "kvfleet.protocol.ENGINE_KINDS names every reader"


def reader(kind: str | None) -> LoadReader:
    """The reader of an engine kind (None: ``kvfleet``); an unknown kind is a ValueError naming it."""
    name = kind or DEFAULT_ENGINE_KIND
    if name not in KINDS:
        raise ValueError(f"unknown engine kind {name!r}: choose one of {', '.join(ENGINE_KINDS)}")
    return KINDS[name]
