"""The router's request path behind the :class:`~kvfleet.router.gateway.gate.Gate` interface.

:class:`RouterGate` runs, for a request Envoy shows it, the router's admission pipeline
(:func:`kvfleet.router.pipeline.admit`, as the router's own HTTP routes do): authenticate,
parse and validate the body, check model and per-request limits, take quota, wait in the
model's admission queue and pick an engine. Envoy then carries the
bytes; the :class:`RouterTicket` watches them go by through the router's
:class:`~kvfleet.router.accounting.Exchange` (first token, usage) and settles the
request exactly once, as the proxy would.

Where the router's own proxy retries a failed connection on another engine, Envoy does
it here: the ticket lists fallback engines after the chosen one, and when the response
names another engine than the chosen one (``x-kvfleet-upstream``), the chosen one is
taken out as failed and the request is counted on the engine that served it.

A stored response's ``GET``, cancel and ``DELETE`` (``/v1/responses/{id}``) take no quota
and no queue, as on the router's own routes: a :class:`StoredTicket` sends them to the one
engine the id's tag names (:func:`kvfleet.router.responses.engine_for`), with no fallback.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvfleet.anthropic_api import anthropic_error_body
from kvfleet.protocol import HEADER_ENGINE
from kvfleet.router import anthropic, pipeline, responses, tokenize
from kvfleet.router.accounting import Exchange
from kvfleet.router.errors import RouterError
from kvfleet.router.fleet import Placement
from kvfleet.router.gateway.gate import Admitted, Outcome, Reply, reply_for
from kvfleet.router.gateway.xds import is_ip
from kvfleet.router.gateway_config import UPSTREAM_HEADER
from kvfleet.router.requests import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from kvfleet.router.state import RouterState
from kvfleet.sse import SseReader

UPSTREAM_TIME = "x-envoy-upstream-service-time"  # present only on responses an upstream sent
PROXIED = (
    COMPLETIONS,
    CHAT,
    RESPONSES,
    EMBEDDINGS,
    *anthropic.PATHS,
    *tokenize.PATHS,
)  # POST routes Envoy carries
_STORED = re.compile(r"/v1/responses/(?P<id>[^/]+)(?P<cancel>/cancel)?")


def anthropic_reply(err: RouterError) -> Reply:
    """A refusal on an Anthropic route, in Anthropic's error shape (as the router's own routes send it)."""
    reply = reply_for(err)
    return Reply(
        reply.status, json.dumps(anthropic_error_body(err.status, err.message)).encode(), reply.headers
    )


@dataclass
class RouterTicket:
    """One admitted request while Envoy relays it; settles it with what the engine reported."""

    ex: Exchange
    fallbacks: tuple[str, ...] = ()
    status: int | None = None
    from_engine: bool = False
    whole: bytearray = field(default_factory=bytearray)
    events: SseReader = field(default_factory=SseReader)

    @property
    def model(self) -> str:
        return self.ex.req.model

    @property
    def engine(self) -> str:
        assert self.ex.placement is not None
        return urlsplit(self.ex.placement.url).netloc

    @property
    def upstream_body(self) -> bytes | None:
        req = self.ex.req  # Envoy sends the client's body unless the usage chunk or the salt must change
        return req.upstream_content() if req.rewritten else None

    @property
    def upstream_headers(self) -> Mapping[str, str]:
        """The ``traceparent`` of the proxied call's span, when the router traces."""
        return {} if self.ex.trace is None else self.ex.trace.start_proxy(self.engine)

    def _streaming(self) -> bool:
        return self.ex.req.stream and self.status == 200 and self.from_engine

    def response_headers(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        self.status = int(headers.get(":status", "0")) or None
        self.from_engine = UPSTREAM_TIME in headers
        served = headers.get(UPSTREAM_HEADER, "")
        if self.from_engine and served != self.engine:
            self._served_by(served)
        added = {HEADER_ENGINE: self.engine}
        if not self.from_engine:
            added.update(_unreachable().headers)
        return added

    def _served_by(self, served: str) -> None:
        """Envoy could not connect to the chosen engine and retried on ``served``: move the request there."""
        ex, fleet = self.ex, self.ex.state.fleet
        assert ex.placement is not None
        url = next((u for u in fleet.engines if urlsplit(u).netloc == served), None)
        if url is None:
            return  # an engine the router no longer knows: keep counting on the chosen one
        chosen = ex.placement
        fleet.mark_failed(chosen.url)
        fleet.release(chosen)
        fleet.engines[url].in_flight += 1
        ex.placement = Placement(url, chosen.model, chosen.score, chosen.hashes)

    def response_chunk(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        if not self.from_engine:
            return _unreachable().body if end_of_stream else b""
        if not self._streaming():
            self.whole += chunk
            return None
        # Invariant: only whole SSE events go on; a partial one waits for the rest of it.
        out = b"".join(
            kept + b"\n\n"
            for event in self.events.events(chunk)
            if (kept := self.ex.on_event(event)) is not None
        )
        if end_of_stream:
            pending = self.events.take_pending()
            out += pending if pending.strip() else b""
        return None if out == chunk else out

    async def finish(self, outcome: Outcome) -> None:
        ex = self.ex
        if self.status is None or (self.from_engine and not outcome.complete):
            await ex.finish(499, used=ex.used_tokens(), reason="client_disconnected")
        elif not self.from_engine:
            await ex.engine_failed()
        elif self.status != 200:
            await ex.finish(self.status, used=0, reason="engine_error")
        elif ex.req.stream:
            await (ex.finish(200, used=ex.used_tokens(), reason=None) if ex.saw_done else ex.engine_failed())
        else:
            await self._finish_whole()

    async def _finish_whole(self) -> None:
        try:
            body = json.loads(bytes(self.whole))
        except json.JSONDecodeError:
            await self.ex.engine_failed()
            return
        self.ex.on_whole(body)
        await self.ex.finish(200, used=self.ex.used_tokens(), reason=None)


@dataclass
class StoredTicket:
    """A stored response's ``GET``/cancel/``DELETE``, sent to the engine that stored it: nothing to settle."""

    model: str  # one the engine serves: Envoy reaches it through that model's cluster
    engine: str
    fallbacks: tuple[str, ...] = ()
    upstream_body: bytes | None = None
    upstream_headers: Mapping[str, str] = field(default_factory=dict)
    from_engine: bool = False

    def response_headers(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        self.from_engine = UPSTREAM_TIME in headers
        return {HEADER_ENGINE: self.engine, **({} if self.from_engine else _unreachable().headers)}

    def response_chunk(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        if self.from_engine:
            return None
        return _unreachable().body if end_of_stream else b""

    async def finish(self, outcome: Outcome) -> None:
        return None


def stored(state: RouterState, method: str, path: str) -> StoredTicket | None:
    """The ticket of a stored response's route (None: ``path`` is not one); 404 when no engine of the fleet holds it."""
    match = _STORED.fullmatch(path)
    wanted = "POST" if match is not None and match["cancel"] else ("GET", "DELETE")
    if match is None or method not in wanted:
        return None
    url = responses.engine_for(state, match["id"])
    engine = state.fleet.engines.get(url) if url is not None else None
    model = state.fleet.model_of(engine) if engine is not None else None
    if engine is None or model is None or not state.fleet.is_ready(engine):
        raise RouterError(
            404,
            "response_not_found",
            f"response {match['id']!r} was not stored by a ready engine of this fleet",
        )
    return StoredTicket(model, urlsplit(engine.url).netloc)


def _unreachable() -> Reply:
    """What the client gets when Envoy could not reach the chosen engine (not Envoy's plain text)."""
    err = RouterError(503, "engine_unreachable", "the chosen engine could not be reached", retry_after_s=1.0)
    return reply_for(err)


def fallbacks(state: RouterState, placement: Placement, n: int) -> tuple[str, ...]:
    """Up to ``n`` other ready engines of the model (``host:port``), the least busy first."""
    others = state.fleet.candidates(placement.model, placement.hashes, exclude=(placement.url,))
    ranked = sorted(others, key=lambda c: (c.busy, c.url))
    return tuple(urlsplit(c.url).netloc for c in ranked[:n])


class RouterGate:
    """The :class:`Gate` of a running router: its tenants, quotas, queues and fleet.

    ``num_retries`` is how many fallback engines each admitted request names.
    """

    def __init__(self, state: RouterState, num_retries: int = 0) -> None:
        self.state = state
        self.num_retries = num_retries

    def endpoints(self) -> dict[str, list[str]]:
        """The ready engines by model; Envoy connects to IP addresses only (pods have them)."""
        fleet, out = self.state.fleet, {}
        for model in sorted(fleet.models()):
            split = [urlsplit(e.url) for e in fleet.ready_engines(model)]
            out[model] = sorted(u.netloc for u in split if is_ip(u.hostname or ""))
        return out

    async def admit(self, headers: Mapping[str, str], body: bytes) -> Admitted | Reply:
        method, path = headers.get(":method", ""), headers.get(":path", "").split("?", 1)[0]
        state, authorization = self.state, pipeline.credentials(headers)
        try:
            if method == "POST" and path in PROXIED:
                ex = await pipeline.admit(state, authorization, path, body, headers)
                assert ex.placement is not None  # admit returns only once placed
                return RouterTicket(ex, fallbacks(state, ex.placement, self.num_retries))
            tenant = pipeline.authenticate(state, authorization)  # a bad key is a 401 on every path
            ticket = stored(state, method, path)
            if ticket is not None:
                return ticket
            if method == "GET" and path == "/v1/models":
                return Reply.json(200, pipeline.models_listing(state, tenant))
        except RouterError as err:
            return anthropic_reply(err) if path in anthropic.PATHS else reply_for(err)
        return reply_for(RouterError(404, "not_found", f"no route for {method} {path} at the gateway"))
