"""The request path end to end: checks, quota, admission, pick, forward, account (DESIGN §1, §6).

:func:`serve` takes an authenticated tenant and a parsed request and returns the
response: the engine's JSON, or its SSE stream passed through chunk by chunk. A
connection that fails before the first byte is retried on another engine; an engine
that dies mid-stream ends the stream with an error event, is taken out of the
picker, and its request's quota is refunded. A client that disconnects closes the
upstream stream, so the engine aborts the sequence. Each request is settled exactly
once with the usage the engine reported (:class:`Exchange`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import anyio
import orjson
from fastapi.responses import Response, StreamingResponse

from kvfleet.protocol import HEADER_ENGINE
from kvfleet.router.accounting import Exchange
from kvfleet.router.admission import Shed, Ticket
from kvfleet.router.errors import RouterError
from kvfleet.router.fleet import Placement
from kvfleet.router.prefix import block_hashes
from kvfleet.router.quota import Denial, QuotaUnavailable
from kvfleet.router.requests import ParsedRequest
from kvfleet.router.state import RouterState
from kvfleet.router.tenants import Tenant

_REASON = {
    "requestsPerMinute": "requests_per_minute",
    "tokensPerMinute": "tokens_per_minute",
    "maxConcurrentRequests": "max_concurrent_requests",
}


def _engine_header(url: str) -> dict[str, str]:
    return {HEADER_ENGINE: urlsplit(url).netloc}


def check_request(state: RouterState, tenant: Tenant, req: ParsedRequest) -> int:
    """Model, permission and per-request limits; returns the token estimate to charge."""
    if not tenant.may_use(req.model):
        raise RouterError(403, "model_not_allowed", f"tenant may not use model {req.model!r}", param="model")
    if req.model not in state.fleet.models():
        raise RouterError(404, "model_not_found", f"model {req.model!r} is not served here", param="model")
    estimate = req.prompt_tokens_estimate(state.config.chars_per_token) + req.max_tokens
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


async def place(state: RouterState, ex: Exchange) -> Placement:
    """An engine for the request: at once, or after waiting in the model's queue."""
    fleet, model = state.fleet, ex.req.model
    hashes = block_hashes(ex.req.prompt, state.config.prefix_chunk_chars)
    kv_tokens = ex.prompt_estimate + ex.req.max_tokens
    service = fleet.service_for(model)
    can_appear = service is not None and service.autoscaling is not None
    cold = not fleet.ready_engines(model)
    if cold:
        if not can_appear:
            raise RouterError(
                503, "no_ready_engine", f"no ready engine serves model {model!r}", retry_after_s=5.0
            )
        if state.autoscaler is not None:
            state.autoscaler.poke()  # held in the queue while the autoscaler scales from zero
    if not state.config.admission:
        placed = fleet.place(
            model, hashes, tokens=kv_tokens, prompt_tokens=ex.prompt_estimate, allow_saturated=True
        )
        if placed is None:
            raise RouterError(
                503, "no_ready_engine", f"no ready engine serves model {model!r}", retry_after_s=5.0
            )
        return placed
    spec = ex.tenant.spec
    ticket: Ticket[Placement] = Ticket(
        tenant=spec.tenant,
        priority=spec.priority,
        weight=spec.weight,
        tokens=ex.prompt_estimate,
        place=lambda: fleet.place(model, hashes, tokens=kv_tokens, prompt_tokens=ex.prompt_estimate),
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
        wait = time.perf_counter() - enqueued
        state.metrics.child(state.metrics.queue_wait, model, spec.tenant).observe(wait)


_JSON_HEADERS = {"content-type": "application/json"}
# aiohttp's errors before the first byte: the engine is not there, or a pooled connection went stale.
_DOWN = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def _send(state: RouterState, ex: Exchange, url: str) -> aiohttp.ClientResponse:
    # A pooled keep-alive connection the engine already closed fails before any byte is
    # read: that is the connection's fault, not the engine's, so it is retried once, fresh.
    content = ex.req.upstream_content()
    for attempt in range(2):
        try:
            return await state.upstream.post(url + ex.req.path, data=content, headers=_JSON_HEADERS)
        except _DOWN:
            raise
        except _STALE:
            if attempt == 1:
                raise
    raise AssertionError("unreachable")


async def open_upstream(state: RouterState, ex: Exchange) -> aiohttp.ClientResponse:
    """Send to the placed engine; before the first byte, a failed connection or a 503 moves to another one.

    An engine's 503 (draining, or its core died: ``engine_dead``) means it started nothing, so the
    request is safe to place again; the engine is out of rotation until a poll finds it ready.
    """
    tried: list[str] = []
    refusal = ""
    while True:
        assert ex.placement is not None
        url = ex.placement.url
        try:
            response = await _send(state, ex, url)
        except (*_DOWN, *_STALE):
            state.fleet.mark_failed(url)
        except TimeoutError:
            state.fleet.mark_failed(url)
            raise RouterError(
                504, "engine_timeout", f"engine {urlsplit(url).netloc} did not answer in time"
            ) from None
        else:
            if response.status != 503:
                state.fleet.heard(url)
                return response
            state.fleet.mark_failed(url)
            refusal = f"; {urlsplit(url).netloc} answered 503 {await _error_code(response)}"
        tried.append(url)
        failed, ex.placement = ex.placement, None
        state.fleet.release(failed)
        retry = None
        if len(tried) <= state.config.max_retries:
            retry = state.fleet.place(
                ex.req.model,
                failed.hashes,
                prompt_tokens=ex.prompt_estimate,
                exclude=tried,
                allow_saturated=True,
            )
        if retry is None:
            if refusal:
                raise RouterError(
                    503, "no_ready_engine", f"no engine could take the request{refusal}", retry_after_s=1.0
                )
            raise RouterError(502, "engine_unreachable", "no engine could be reached", retry_after_s=1.0)
        ex.placement = retry


async def _error_code(response: aiohttp.ClientResponse) -> str:
    """The ``error.code`` of an engine's error body (read whole, the connection released), or ''."""
    try:
        body = orjson.loads(await response.read())
        return str(body["error"]["code"])
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, KeyError, TypeError):
        return ""
    finally:
        response.release()


@contextlib.asynccontextmanager
async def settled_on_error(ex: Exchange) -> AsyncIterator[None]:
    """An error inside settles the exchange (quota, in-flight, metrics) before it propagates."""
    try:
        yield
    except RouterError as err:
        await ex.finish(err.status, used=None, reason=err.code)
        raise
    except BaseException:  # the client left (or Envoy gave up) while queued or connecting
        with anyio.CancelScope(shield=True):
            await ex.finish(499, used=None, reason="client_disconnected")
        raise


async def admit(state: RouterState, tenant: Tenant, req: ParsedRequest) -> Exchange:
    """Validate, take quota, wait for admission and place: the steps the proxy and the gateway share."""
    estimate = check_request(state, tenant, req)
    ex = Exchange(
        state, tenant, req, prompt_estimate=req.prompt_tokens_estimate(state.config.chars_per_token)
    )
    async with settled_on_error(ex):
        await take_quota(state, ex, estimate)
        ex.placement = await place(state, ex)
    return ex


async def serve(state: RouterState, tenant: Tenant, req: ParsedRequest) -> Response:
    ex = await admit(state, tenant, req)
    async with settled_on_error(ex):
        upstream = await open_upstream(state, ex)
    assert ex.placement is not None  # open_upstream returns only once placed on an engine that answered
    headers = _engine_header(ex.placement.url)
    if upstream.status != 200 or not req.stream:
        return await relay_whole(ex, upstream, headers)
    return StreamingResponse(relay_stream(ex, upstream), media_type="text/event-stream", headers=headers)


async def relay_whole(ex: Exchange, upstream: aiohttp.ClientResponse, headers: dict[str, str]) -> Response:
    try:
        content = await upstream.read()
    except (aiohttp.ClientError, TimeoutError):
        upstream.close()
        await ex.engine_failed()
        raise RouterError(
            502, "engine_failed", "the engine failed before answering", retry_after_s=1.0
        ) from None
    upstream.release()
    if upstream.status != 200:
        await ex.finish(upstream.status, used=0, reason="engine_error")
        return Response(content, status_code=upstream.status, headers=headers, media_type="application/json")
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        await ex.engine_failed()
        raise RouterError(502, "engine_failed", "the engine answered with invalid JSON")
    ex.usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
    await ex.finish(200, used=ex.used_tokens(), reason=None)
    return Response(content, headers=headers, media_type="application/json")  # as the engine sent it


@dataclass
class _Events:
    """Splits an SSE byte stream into whole events."""

    buffer: bytes = b""
    ready: list[bytes] = field(default_factory=list)

    def feed(self, chunk: bytes) -> list[bytes]:
        self.buffer += chunk.replace(b"\r\n", b"\n")
        *events, self.buffer = self.buffer.split(b"\n\n")
        return [e for e in events if e.strip()]


async def relay_stream(ex: Exchange, upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    events = _Events()
    outcome, prefilling = "client_gone", True
    try:
        async for chunk in upstream.content.iter_any():
            # What one read brought goes on in one write: each event as it arrived, untouched.
            out = b"".join(o + b"\n\n" for e in events.feed(chunk) if (o := ex.on_event(e)) is not None)
            if prefilling and ex.first_at is not None and ex.placement is not None:
                prefilling = False  # the first content token: the prompt is computed
                ex.state.fleet.prefilled(ex.placement)
            if out:
                yield out
        outcome = "ok" if ex.saw_done else "engine_failed"
        if not ex.saw_done:
            yield ex.cut_off_error().sse() + b"data: [DONE]\n\n"
    except (aiohttp.ClientError, TimeoutError):
        outcome = "engine_failed"
        yield ex.cut_off_error().sse() + b"data: [DONE]\n\n"
    finally:
        with anyio.CancelScope(shield=True):
            if outcome == "ok":
                upstream.release()  # read to the end: the connection goes back to the pool
            else:
                upstream.close()  # closing the connection is what aborts the sequence on the engine
            if outcome == "ok":
                await ex.finish(200, used=ex.used_tokens(), reason=None)
            elif outcome == "engine_failed":
                await ex.engine_failed()
            else:
                await ex.finish(499, used=ex.used_tokens(), reason="client_disconnected")
