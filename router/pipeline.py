"""The router's admission pipeline: what happens to a request before any byte goes to an engine.

Where it sits: both transports call :func:`admit`, the one entry: the HTTP routes
(:mod:`kvfleet.router.routes.completions`, which then relay through
:mod:`kvfleet.router.proxy`) and the Envoy gateway (:mod:`kvfleet.router.gateway.router_gate`,
where Envoy carries the bytes). The steps, in order (docs/architecture.md §6):

1. authenticate: ``Authorization: Bearer <key>`` (or ``x-api-key``) → tenant (:mod:`kvfleet.router.tenants`);
2. parse and validate the body (:mod:`kvfleet.router.requests`);
3. checks: the tenant may use the model, the fleet serves it, per-request token limits;
4. quota: requests/min, tokens/min, concurrency (:mod:`kvfleet.router.quota`);
5. place: an engine at once, or after waiting in the model's fair queue
   (:mod:`kvfleet.router.admission`, :mod:`kvfleet.router.fleet`, :mod:`kvfleet.router.picker`);
6. settle on error: a refusal after the quota was taken settles the request
   (:func:`settled_on_error`), exactly once, before the error propagates.

Every refusal is a :class:`~kvfleet.router.errors.RouterError`; the transports turn it into
their reply. ``GET /v1/models`` is answered here too (:func:`models_listing`), for both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio

from kvfleet.router import anthropic, tokenize
from kvfleet.router.accounting import Exchange
from kvfleet.router.admission import Shed, Ticket
from kvfleet.router.errors import RouterError
from kvfleet.router.fleet import Placement, first_poll_done
from kvfleet.router.kv_index import PreciseQuery
from kvfleet.router.prefix import block_hashes, cache_namespace, engine_cache_salt, shares_prefix_cache
from kvfleet.router.prompt_tokens import prompt_token_ids
from kvfleet.router.quota import Denial, QuotaUnavailable
from kvfleet.router.requests import EMBEDDINGS, ParsedRequest, parse_request
from kvfleet.router.responses import pinned_exclusions
from kvfleet.router.state import RouterState
from kvfleet.router.tenants import Tenant
from kvfleet.router.tracing import AUTHENTICATED, CHECKED, PLACED, QUOTA, RequestTrace

log = logging.getLogger(__name__)

_REASON = {
    "requestsPerMinute": "requests_per_minute",
    "tokensPerMinute": "tokens_per_minute",
    "maxConcurrentRequests": "max_concurrent_requests",
}


def credentials(headers: Mapping[str, str]) -> str | None:
    """The ``Authorization`` header, or Anthropic's ``x-api-key: <key>`` read as ``Bearer <key>``."""
    authorization = headers.get("authorization")
    key = headers.get("x-api-key")
    return f"Bearer {key}" if authorization is None and key else authorization


def authenticate(state: RouterState, authorization: str | None) -> Tenant:
    """``Authorization: Bearer <key>`` → tenant, or 401 (the key is never echoed or logged)."""
    scheme, _, key = (authorization or "").partition(" ")
    tenant = state.tenants.authenticate(key.strip()) if scheme.lower() == "bearer" and key.strip() else None
    if tenant is None:
        reason = "missing_api_key" if not authorization else "invalid_api_key"
        state.metrics.reject("unknown", "unknown", reason, 401)
        message = (
            "missing API key: send 'Authorization: Bearer <key>'" if not authorization else "invalid API key"
        )
        raise RouterError(401, reason, message)
    return tenant


def models_listing(state: RouterState, tenant: Tenant) -> dict[str, Any]:
    """``GET /v1/models``: the models this tenant may use that the fleet serves."""
    names = sorted(m for m in state.fleet.models() if may_use(state, tenant, m))
    return {"object": "list", "data": [_model_card(state, m) for m in names]}


def model_card(state: RouterState, tenant: Tenant, model: str) -> dict[str, Any]:
    """``GET /v1/models/{model}``: one of them, or a 404 (also for a model the tenant may not use)."""
    if not may_use(state, tenant, model) or model not in state.fleet.models():
        raise RouterError(404, "model_not_found", f"model {model!r} is not served here", param="model")
    return _model_card(state, model)


def _model_card(state: RouterState, model: str) -> dict[str, Any]:
    created = state.models_created.setdefault(model, int(state.clock()))  # when this router first served it
    return {"id": model, "object": "model", "created": created, "owned_by": "kvfleet"}


def may_use(state: RouterState, tenant: Tenant, model: str) -> bool:
    """The tenant's models allow it, and an adapter another tenant names is that tenant's alone."""
    if not tenant.may_use(model):
        return False
    return not (state.fleet.is_adapter(model) and state.tenants.claimed_by_another(tenant, model))


def check_request(state: RouterState, tenant: Tenant, req: ParsedRequest, prompt_estimate: int) -> int:
    """Model, permission and per-request limits; returns the token estimate to charge."""
    if not may_use(state, tenant, req.model):
        raise RouterError(403, "model_not_allowed", f"tenant may not use model {req.model!r}", param="model")
    if req.model not in state.fleet.models():
        raise RouterError(404, "model_not_found", f"model {req.model!r} is not served here", param="model")
    estimate = prompt_estimate + req.max_tokens
    limits = tenant.spec.limits
    if limits.max_tokens_per_request is not None and estimate > limits.max_tokens_per_request:
        msg = (
            f"request needs up to {estimate} tokens (prompt estimate + max_tokens), over the tenant's "
            f"maxTokensPerRequest={limits.max_tokens_per_request}"
        )
        raise RouterError(400, "max_tokens_per_request", msg, param="max_tokens")
    if limits.tokens_per_minute is not None and estimate > limits.tokens_per_minute:
        msg = f"request needs up to {estimate} tokens, over the tenant's tokensPerMinute={limits.tokens_per_minute}"
        raise RouterError(400, "tokens_per_minute", msg, param="max_tokens")
    return estimate


async def take_quota(state: RouterState, ex: Exchange, estimate: int) -> None:
    try:
        got = await state.quota.acquire(ex.tenant.name, ex.tenant.spec.limits, estimate)
    except QuotaUnavailable as exc:
        raise RouterError(503, "quota_store_unavailable", str(exc), retry_after_s=5.0) from None
    if isinstance(got, Denial):
        raise RouterError(429, _REASON[got.limit], got.message, retry_after_s=got.retry_after_s)
    ex.charge = got


def _no_ready_engine(model: str) -> RouterError:
    return RouterError(503, "no_ready_engine", f"no ready engine serves model {model!r}", retry_after_s=5.0)


async def place(state: RouterState, ex: Exchange) -> Placement:
    """An engine for the request: at once, or after waiting in the model's queue."""
    fleet, model = state.fleet, ex.req.model
    adapter = model if fleet.is_adapter(model) else None
    namespace = cache_namespace(cache_salt=ex.req.cache_salt, adapter=adapter)
    hashes = block_hashes(ex.req.prompt, state.config.prefix_chunk_chars, namespace)
    precise = await _precise_query(state, ex, adapter)
    pinned = pinned_exclusions(state, ex.req)  # a Responses follow-up: only its predecessor's engine
    kv_tokens = ex.prompt_estimate + ex.req.max_tokens
    service = fleet.service_for(model)
    # engines can appear when the autoscaler may add them, or when the InferenceService wants some:
    # between a rollout's old pod leaving and its new one being seen ready, a request waits
    can_appear = service is not None and (service.autoscaling is not None or (service.replicas or 0) > 0)
    cold = not fleet.ready_engines(model)
    if cold:
        if not can_appear:
            raise _no_ready_engine(model)
        if state.autoscaler is not None:
            state.autoscaler.poke()  # held in the queue while the autoscaler scales from zero
    if not state.config.admission:
        placed = fleet.place(
            model,
            hashes,
            tokens=kv_tokens,
            prompt_tokens=ex.prompt_estimate,
            exclude=pinned,
            allow_saturated=True,
            precise=precise,
        )
        if placed is None:
            raise _no_ready_engine(model)
        return placed
    spec = ex.tenant.spec
    ticket: Ticket[Placement] = Ticket(
        tenant=spec.tenant,
        priority=spec.priority,
        weight=spec.weight,
        tokens=ex.prompt_estimate,
        place=lambda: _timed(
            ex,
            lambda: fleet.place(
                model,
                hashes,
                tokens=kv_tokens,
                prompt_tokens=ex.prompt_estimate,
                exclude=pinned,
                precise=precise,
            ),
        ),
        max_queued=spec.limits.max_queued_requests,
    )
    queue = state.queue(model)
    enqueued = time.perf_counter()
    try:
        return await queue.admit(ticket, state.config.cold_start_wait_s if cold else None)
    except Shed as shed:
        raise RouterError(shed.status, shed.reason, shed.message, retry_after_s=shed.retry_after_s) from None
    except QuotaUnavailable as exc:
        raise RouterError(503, "quota_store_unavailable", str(exc), retry_after_s=5.0) from None
    finally:
        state.metrics.child(state.metrics.queue_depth, model).set(len(queue))
        wait = ex.queue_wait_s = time.perf_counter() - enqueued
        state.metrics.child(state.metrics.queue_wait, model, spec.tenant).observe(wait)


async def _precise_query(state: RouterState, ex: Exchange, adapter: str | None) -> PreciseQuery | None:
    """The request as the KV index is asked about it, where its model is routed precise-prefix."""
    fleet = state.fleet
    if not fleet.wants_precise(ex.req.model):
        return None
    ready = fleet.ready_engines(ex.req.model)
    tokens = await prompt_token_ids(state.client, ready[0].url, ex.req) if ready else None
    if tokens is None:
        return None
    return PreciseQuery(tuple(tokens), ex.req.cache_salt, adapter, state.config.vllm_hash_seed)


def _timed(ex: Exchange, pick: Callable[[], Placement | None]) -> Placement | None:
    """The picker's call, its time kept for the trace's engine_pick span."""
    if ex.trace is None:
        return pick()
    t = time.perf_counter()
    placed = pick()
    ex.trace.pick_s = time.perf_counter() - t
    return placed


@contextlib.asynccontextmanager
async def settled_on_error(ex: Exchange) -> AsyncIterator[None]:
    """An error inside settles the exchange (quota, in-flight, metrics) before it propagates."""
    try:
        yield
    except RouterError as err:
        await ex.finish(err.status, used=None, reason=err.code)
        raise
    except Exception as exc:  # a bug: a 500 in the OpenAI error shape, counted as one
        log.exception("unexpected error admitting a request of tenant %s", ex.tenant.name)
        await ex.finish(500, used=None, reason="internal_error")
        raise RouterError(500, "internal_error", f"internal error: {type(exc).__name__}") from exc
    except BaseException:  # the client left (or Envoy gave up) while queued or connecting
        with anyio.CancelScope(shield=True):
            await ex.finish(499, used=None, reason="client_disconnected")
        raise


def salted(state: RouterState, tenant: Tenant, req: ParsedRequest) -> ParsedRequest:
    """The request with the ``cache_salt`` its engine gets (:func:`~kvfleet.router.prefix.engine_cache_salt`)."""
    if req.path in tokenize.PATHS or req.path == anthropic.COUNT_TOKENS:
        return req  # nothing is cached: the engine takes no cache_salt there
    if req.path == EMBEDDINGS:  # a pooling engine keeps no KV cache to share: its body goes as sent
        return req
    shared = shares_prefix_cache(state.fleet.service_for(req.model), state.config.shared_prefix_cache)
    return dataclasses.replace(req, cache_salt=engine_cache_salt(tenant.name, req.cache_salt, shared))


def _parse(state: RouterState, tenant: Tenant, path: str, body: bytes) -> ParsedRequest:
    try:
        if path in anthropic.PATHS:
            return anthropic.parse_anthropic(path, body)
        if path in tokenize.PATHS:
            return tokenize.parse_tokenizer_request(path, body)
        return parse_request(path, body, state.config.default_max_tokens)
    except RouterError as err:
        state.metrics.reject("unknown", tenant.name, err.code, err.status)
        raise


async def admit(
    state: RouterState, authorization: str | None, path: str, body: bytes, headers: Mapping[str, str] = {}
) -> Exchange:
    """The pipeline, steps 1 to 6: an :class:`Exchange` placed on an engine, or a :class:`RouterError`.

    ``headers`` are the client's, for its ``traceparent`` when the router traces."""
    trace = None if state.tracing is None else RequestTrace(state.tracing, headers, f"POST {path}")
    try:
        tenant = authenticate(state, authorization)
        _mark(trace, AUTHENTICATED)
        req = salted(state, tenant, _parse(state, tenant, path, body))
        prompt_estimate = req.prompt_tokens_estimate(state.config.chars_per_token)
        await first_poll_done(state.fleet)
        estimate = check_request(state, tenant, req, prompt_estimate)
    except RouterError as err:
        if trace is not None:
            trace.finish({}, err.status, err.code)
        raise
    ex = Exchange(state, tenant, req, prompt_estimate=prompt_estimate, trace=trace)
    async with settled_on_error(ex):
        _mark(trace, CHECKED)
        await take_quota(state, ex, estimate)
        _mark(trace, QUOTA)
        ex.placement = await place(state, ex)
        _mark(trace, PLACED)
    return ex


def _mark(trace: RequestTrace | None, step: str) -> None:
    if trace is not None:
        trace.mark(step)
