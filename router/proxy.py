"""The HTTP relay: an admitted request to its engine and the engine's answer back (docs/architecture.md §6).

Where it sits: after :func:`kvfleet.router.pipeline.admit` has placed the request (the
routes of :mod:`kvfleet.router.routes.completions` call both), :func:`serve` sends it to
the engine and returns the response: the engine's JSON, or its SSE stream passed through
chunk by chunk. A connection that fails before the first byte, or an engine's 503, is
retried on another engine; an engine that dies mid-stream ends the stream with an error
event, is taken out of the picker, and its request's quota is refunded. A client that
disconnects, or reads nothing for ``stream_stall_timeout_s`` (:mod:`kvfleet.streaming`), closes the
upstream stream, so the engine aborts the sequence. Each request is
settled exactly once with the usage the engine reported (:class:`Exchange`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import anyio
import orjson
from fastapi.responses import Response

from kvfleet.protocol import HEADER_ENGINE
from kvfleet.router.accounting import Exchange
from kvfleet.router.errors import RouterError
from kvfleet.router.pipeline import settled_on_error
from kvfleet.router.state import RouterState
from kvfleet.sse import SseReader
from kvfleet.streaming import StallBoundedStream


def _engine_header(url: str) -> dict[str, str]:
    return {HEADER_ENGINE: urlsplit(url).netloc}


_JSON_HEADERS = {"content-type": "application/json"}
# aiohttp's errors before the first byte: the engine is not there, or a pooled connection went stale.
_DOWN = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


async def _send(state: RouterState, ex: Exchange, url: str) -> aiohttp.ClientResponse:
    # A pooled keep-alive connection the engine already closed fails before any byte is
    # read: that is the connection's fault, not the engine's, so it is retried once, fresh.
    content = ex.req.upstream_content()
    headers = _JSON_HEADERS
    if ex.trace is not None:  # the engine's spans become children of the proxied call's
        headers = {**headers, **ex.trace.start_proxy(urlsplit(url).netloc)}
    for attempt in range(2):
        try:
            return await state.upstream.post(url + ex.req.path, data=content, headers=headers)
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


async def serve(state: RouterState, ex: Exchange) -> Response:
    """Relay an admitted request (``ex.placement`` set) and settle it once its answer is through."""
    async with settled_on_error(ex):
        upstream = await open_upstream(state, ex)
    assert ex.placement is not None  # open_upstream returns only once placed on an engine that answered
    headers = _engine_header(ex.placement.url)
    if upstream.status != 200 or not ex.req.stream:
        return await relay_whole(ex, upstream, headers)
    stall_s = state.config.stream_stall_timeout_s  # a client reading nothing this long: closed, settled (499)
    return StallBoundedStream(relay_stream(ex, upstream), stall_timeout_s=stall_s, headers=headers)


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
    ex.on_whole(body)
    await ex.finish(200, used=ex.used_tokens(), reason=None)
    return Response(content, headers=headers, media_type="application/json")  # as the engine sent it


async def relay_stream(ex: Exchange, upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    events = SseReader()
    outcome, prefilling = "client_gone", True
    try:
        async for chunk in upstream.content.iter_any():
            # What one read brought goes on in one write: each event as it arrived, untouched.
            out = b"".join(o + b"\n\n" for e in events.events(chunk) if (o := ex.on_event(e)) is not None)
            if prefilling and ex.first_at is not None and ex.placement is not None:
                prefilling = False  # the first content token: the prompt is computed
                ex.state.fleet.prefilled(ex.placement)
            if out:
                yield out
        outcome = "ok" if ex.saw_done else "engine_failed"
        if not ex.saw_done:
            yield ex.cut_off_events()
    except (aiohttp.ClientError, TimeoutError):
        outcome = "engine_failed"
        yield ex.cut_off_events()
    except Exception:  # a bug mid-stream: counted as the 500 it is, not as a client that left
        outcome = "internal_error"
        raise
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
            elif outcome == "internal_error":
                await ex.finish(500, used=ex.used_tokens(), reason="internal_error")
            else:
                await ex.finish(499, used=ex.used_tokens(), reason="client_disconnected")
