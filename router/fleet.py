"""The router's picture of the engines: load, readiness, its own in-flight counts (docs/architecture.md §6).

Discovery gives the URLs and each engine's kind; the poller reads each engine's load every
``load_interval_s`` the way its kind says (:mod:`.engine_kinds`: a kvfleet engine's ``GET /load``,
a vLLM server's ``GET /metrics``). A loaded engine is not an unready one: a load slower than
``load_timeout_s`` is skipped, not held against the engine. An engine is *ready* while
it has answered (a load, or the first byte of a proxied response) within
``engine_silent_s``, its load says it is ready and not draining, and nothing has failed on it since (a refused
connection, a bad answer or a stream cut off takes it out at once; the next good poll
brings it back). A load older than ``load_stale_s`` is not trusted: its running and
waiting counts give way to the router's own in-flight count. :meth:`Fleet.place` runs the picker over the ready engines of a model
and reserves the chosen one; :meth:`Fleet.release` gives it back.

LoRA adapters: an engine whose load carries ``lora`` also has its ``GET /v1/models`` read (at
first, every ``adapters_interval_s``, and at once when it reports a resident adapter the router
does not know), and the cards with a ``parent`` are its adapters. A request naming an adapter
goes only to the engines configured with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from kvfleet.protocol import DEFAULT_ENGINE_KIND, EngineLoad
from kvfleet.router.config import RouterConfig
from kvfleet.router.discovery import Discovery, Endpoint, FleetView, Service
from kvfleet.router.engine_kinds import PollMiss, reader
from kvfleet.router.engine_kinds import fetch_load as fetch_load  # re-exported: its old home
from kvfleet.router.kv_index import KVIndex, PreciseQuery
from kvfleet.router.picker import Candidate, PickContext, choose, is_saturated, policy, prefix_score
from kvfleet.router.prefix import PrefixIndex
from kvfleet.router.quota import Clock

log = logging.getLogger(__name__)

RATE_MIN_TOKENS = 64  # shorter prefills say more about the queue than about the rate
RATE_SMOOTHING = 0.2  # weight of each new sample in ``prefill_rate``


@dataclass(frozen=True)
class Prefill:
    """A placed request's uncached prompt tokens, and when it was placed."""

    tokens: int
    at: float


@dataclass
class EngineState:
    url: str
    service: str | None = None
    kind: str = DEFAULT_ENGINE_KIND  # how its load is read (:mod:`.engine_kinds`)
    load: EngineLoad | None = None
    loaded_at: float | None = None
    heard_at: float | None = None  # its last answer: a load or a proxied response
    failed_at: float | None = None
    in_flight: int = 0
    pending_tokens: int = 0  # of requests placed since ``load`` was read
    prefilling: dict[int, Prefill] = field(default_factory=dict)  # by ticket, until the first byte
    adapters: frozenset[str] = frozenset()  # LoRA adapters it is configured with (its /v1/models)
    adapters_at: float | None = None  # when ``adapters`` was read
    adapters_sent: set[str] = field(default_factory=set)  # adapters placed here since ``load`` was read

    def adapters_stale(self, now: float, interval: float) -> bool:
        """Its adapter list needs reading: it serves adapters and the list is old or misses a resident one."""
        lora = self.load.lora if self.load is not None else None
        if lora is None:
            return False
        if self.adapters_at is None or now - self.adapters_at >= interval:
            return True
        return not set(lora.resident) <= self.adapters


@dataclass(frozen=True)
class Placement:
    """An engine reserved for one request (release it exactly once)."""

    url: str
    model: str
    score: float
    hashes: tuple[int, ...] = ()
    ticket: int = 0  # this placement's key in its engine's ``prefilling``


@dataclass
class Fleet:
    config: RouterConfig
    clock: Clock
    engines: dict[str, EngineState] = field(default_factory=dict)
    services: dict[str, Service] = field(default_factory=dict)
    on_change: Callable[[str], None] | None = None
    _rotation: dict[str, int] = field(default_factory=dict)
    _tickets: Iterator[int] = field(default_factory=itertools.count)
    prefill_rate: float = 0.0  # uncached tokens per second to the first byte: the prior, then averaged
    rate_measured: bool = False  # the first sample replaces the prior outright
    # Set once the poller's first round is done (None: no poller, as in unit tests). Until then the
    # router knows no engine's models, and a request waits for that round instead of a false 404.
    first_poll: asyncio.Event | None = None
    kv_index: KVIndex | None = None  # the engines' KV events (router/kv_events_sub.py), if followed

    def __post_init__(self) -> None:
        self.prefix = PrefixIndex(self.config.prefix_index_blocks)
        self.prefill_rate = self.config.prefill_rate_prior
        self.context = PickContext(
            self.config.picker_weights, self.config.max_engine_queue, self.config.saturation_kv_usage
        )

    def apply_view(self, view: FleetView) -> None:
        self.services = {s.key: s for s in view.services}
        wanted = {e.url: e for e in view.endpoints}
        for url in [u for u in self.engines if u not in wanted]:
            del self.engines[url]
            self.prefix.forget(url)
            if self.kv_index is not None:
                self.kv_index.forget(url)
        for url, endpoint in wanted.items():
            engine = self.engines.setdefault(url, EngineState(url))
            engine.service, engine.kind = endpoint.service, self.kind_of(endpoint)

    def kind_of(self, endpoint: Endpoint) -> str:
        """The endpoint's own kind, else its InferenceService's (``spec.engine.kind``), else ``kvfleet``."""
        service = self.services.get(endpoint.service) if endpoint.service else None
        return endpoint.kind or (service.engine_kind if service else None) or DEFAULT_ENGINE_KIND

    def observe(self, url: str, load: EngineLoad | PollMiss) -> None:
        engine = self.engines.get(url)
        if engine is None or load is PollMiss.SLOW:
            return
        if isinstance(load, PollMiss):
            self.mark_failed(url)
            return
        now = self.clock()
        engine.load, engine.loaded_at, engine.heard_at, engine.pending_tokens = load, now, now, 0
        engine.adapters_sent.clear()

    def observe_adapters(self, url: str, adapters: frozenset[str] | None) -> None:
        """An engine's adapters as its ``/v1/models`` lists them (None: not read this time)."""
        engine = self.engines.get(url)
        if engine is not None and adapters is not None:
            engine.adapters, engine.adapters_at = adapters, self.clock()

    def heard(self, url: str) -> None:
        """The engine answered a proxied request: it is alive, whatever its ``/load`` does."""
        engine = self.engines.get(url)
        if engine is not None:
            engine.heard_at = self.clock()

    def mark_failed(self, url: str) -> None:
        engine = self.engines.get(url)
        if engine is not None:
            engine.failed_at = self.clock()

    def is_ready(self, engine: EngineState) -> bool:
        if engine.load is None or engine.heard_at is None or engine.load.draining or not engine.load.ready:
            return False
        if self.clock() - engine.heard_at > self.config.engine_silent_s:
            return False
        return engine.failed_at is None or engine.heard_at > engine.failed_at

    def trusted_load(self, engine: EngineState) -> EngineLoad | None:
        """The last load; past ``load_stale_s`` without its running/waiting counts (in-flight stands in)."""
        load = engine.load
        if (
            load is None
            or engine.loaded_at is None
            or self.clock() - engine.loaded_at <= self.config.load_stale_s
        ):
            return load
        return load.model_copy(update={"num_running": 0, "num_waiting": 0})

    def model_of(self, engine: EngineState) -> str | None:
        if engine.service is not None and engine.service in self.services:
            return self.services[engine.service].model
        return engine.load.model if engine.load is not None else None

    def serves(self, engine: EngineState, model: str) -> bool:
        return self.model_of(engine) == model or model in engine.adapters

    def adapters(self) -> set[str]:
        """Every adapter some engine is configured with (the only adapter names metrics may carry)."""
        return {a for e in self.engines.values() for a in e.adapters}

    def is_adapter(self, model: str) -> bool:
        return any(model in e.adapters for e in self.engines.values())

    def models(self) -> set[str]:
        named = {s.model for s in self.services.values()}
        return (
            named
            | {m for e in self.engines.values() if (m := self.model_of(e)) is not None}
            | self.adapters()
        )

    def service_for(self, model: str) -> Service | None:
        """The InferenceService of a model, or of the base model an adapter belongs to."""
        found = next((s for s in self.services.values() if s.model == model), None)
        if found is None and self.is_adapter(model):
            base = next((self.model_of(e) for e in self.engines.values() if model in e.adapters), None)
            found = next((s for s in self.services.values() if s.model == base), None)
        return found

    def ready_engines(self, model: str) -> list[EngineState]:
        return [e for e in self.engines.values() if self.serves(e, model) and self.is_ready(e)]

    def wants_precise(self, model: str) -> bool:
        """The model is routed by the engines' KV events: they are followed and its policy reads them."""
        return self.kv_index is not None and self.policy_name(model) == "precise-prefix"

    def precise_prefix(
        self, engine: EngineState, load: EngineLoad, query: PreciseQuery | None
    ) -> float | None:
        """The share of the prompt the engine's events say it holds; None where they are not to be trusted."""
        if query is None or self.kv_index is None:
            return None
        busy = engine.in_flight > 0 or load.num_running + load.num_waiting > 0
        feed = self.kv_index.feeds.get(engine.url)
        block_size = feed.block_size if feed is not None and feed.block_size else load.block_size
        hashes = query.hashes(engine.kind, block_size)  # as its events say it hashes
        if hashes is None or self.kv_index.is_stale(engine.url, busy):
            return None
        return self.kv_index.held(engine.url, hashes).fraction

    def candidates(
        self,
        model: str,
        hashes: Sequence[int],
        exclude: Sequence[str] = (),
        precise: PreciseQuery | None = None,
    ) -> list[Candidate]:
        ready = [e for e in self.ready_engines(model) if e.url not in exclude]
        matched = self.prefix.matched_blocks(hashes, [e.url for e in ready])
        adapter = model if self.is_adapter(model) else None
        return [
            Candidate(
                e.url,
                load,
                e.in_flight,
                matched[e.url],
                len(hashes),
                e.pending_tokens,
                self.prefix.prompt_starts(e.url),
                self.backlog(e),
                adapter,
                frozenset(e.adapters_sent),
                self.precise_prefix(e, load, precise),
            )
            for e in sorted(ready, key=lambda e: e.url)
            if (load := self.trusted_load(e)) is not None
        ]

    def place(
        self,
        model: str,
        hashes: Sequence[int],
        *,
        tokens: int = 0,
        prompt_tokens: int = 0,
        exclude: Sequence[str] = (),
        allow_saturated: bool = False,
        precise: PreciseQuery | None = None,
    ) -> Placement | None:
        """Pick and reserve an engine. ``tokens`` (the request's KV estimate) counts against it until the
        next load; the part of ``prompt_tokens`` it has not cached counts as its backlog until the first byte."""
        cands = self.candidates(model, hashes, exclude, precise)
        if not allow_saturated:
            cands = [c for c in cands if not is_saturated(c, self.context)]
        pol = policy(self.policy_name(model))
        rotation = self._rotation.get(model, 0)
        choice = choose(cands, pol, self.context, rotation)
        if choice is None:
            return None
        self._rotation[model] = rotation + 1
        engine, ticket = self.engines[choice.url], next(self._tickets)
        engine.in_flight += 1
        engine.pending_tokens += tokens
        if self.is_adapter(model):
            engine.adapters_sent.add(model)
        chosen = next(c for c in cands if c.url == choice.url)
        cached = prefix_score(chosen, self.context)
        engine.prefilling[ticket] = Prefill(round(prompt_tokens * (1.0 - cached)), self.clock())
        self.prefix.record(hashes, choice.url)
        return Placement(choice.url, model, choice.score, tuple(hashes), ticket)

    def policy_name(self, model: str) -> str:
        """The service's policy, else the router's; a request naming an adapter turns ``default`` adapter-aware."""
        service = self.service_for(model)
        name = (service.policy if service and service.policy else None) or self.config.policy
        return "adapter-aware" if name == "default" and self.is_adapter(model) else name

    def backlog(self, engine: EngineState) -> int:
        # Invariant: each prefill still awaiting its first byte counts its uncached tokens less what
        # ``prefill_rate`` would have computed since it was placed, never below zero; so of two
        # engines given the same prompt, the one given it earlier is the nearer to done.
        now, rate = self.clock(), self.prefill_rate
        return sum(max(0, round(p.tokens - rate * (now - p.at))) for p in engine.prefilling.values())

    def prefilled(self, placement: Placement) -> None:
        """Its first byte came back: the prompt is computed, no longer the engine's backlog.

        A long enough prompt also updates ``prefill_rate`` (an average of tokens over time to
        first byte: queueing included, so it errs slow)."""
        engine = self.engines.get(placement.url)
        done = engine.prefilling.pop(placement.ticket, None) if engine is not None else None
        elapsed = self.clock() - done.at if done is not None else 0.0
        if done is None or done.tokens < RATE_MIN_TOKENS or elapsed <= 0:
            return
        sample = done.tokens / elapsed
        weight = RATE_SMOOTHING if self.rate_measured else 1.0
        self.prefill_rate += weight * (sample - self.prefill_rate)
        self.rate_measured = True

    def release(self, placement: Placement) -> None:
        engine = self.engines.get(placement.url)
        if engine is not None:
            engine.in_flight = max(0, engine.in_flight - 1)
            engine.prefilling.pop(placement.ticket, None)
        if self.on_change is not None:  # the room it freed may serve its base model or any of its adapters
            served = {placement.model} if engine is None else {placement.model, *engine.adapters}
            base = self.model_of(engine) if engine is not None else None
            for model in sorted(served | ({base} if base else set())):
                self.on_change(model)


async def poll_once(fleet: Fleet, discovery: Discovery, client: httpx.AsyncClient) -> None:
    fleet.apply_view(await discovery.view())
    urls = list(fleet.engines)
    timeout = fleet.config.load_timeout_s
    kinds = {u: reader(fleet.engines[u].kind) for u in urls}
    loads = await asyncio.gather(*(kinds[u].load(client, u, timeout) for u in urls))
    for url, load in zip(urls, loads, strict=True):
        fleet.observe(url, load)
    now, interval = fleet.clock(), fleet.config.adapters_interval_s
    stale = [u for u in urls if (e := fleet.engines.get(u)) is not None and e.adapters_stale(now, interval)]
    listed = await asyncio.gather(*(kinds[u].adapters(client, u, timeout) for u in stale))
    for url, adapters in zip(stale, listed, strict=True):
        fleet.observe_adapters(url, adapters)
    if fleet.on_change is not None:
        for model in fleet.models():
            fleet.on_change(model)
    if fleet.first_poll is not None:
        fleet.first_poll.set()


async def first_poll_done(fleet: Fleet) -> None:
    """Wait (boundedly) for the poller's first round: a router just started knows no model yet."""
    if fleet.first_poll is None or fleet.first_poll.is_set():
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(fleet.first_poll.wait(), fleet.config.load_timeout_s + 1.0)


async def poll_forever(fleet: Fleet, discovery: Discovery, client: httpx.AsyncClient) -> None:
    while True:
        try:
            await poll_once(fleet, discovery, client)
        except Exception:  # a bad view must not stop the poller; the next tick retries
            log.exception("load poll failed")
        await asyncio.sleep(fleet.config.load_interval_s)
