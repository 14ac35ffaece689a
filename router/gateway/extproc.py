"""The router's ext_proc server: Envoy asks it about every request and shows it every response.

One gRPC stream per HTTP request (Envoy's ``ExternalProcessor.Process``), in the
processing mode :func:`kvfleet.router.gateway.xds.ext_proc_filter` configures:

1. request headers → continue (the body follows, buffered whole);
2. request body → :meth:`Gate.admit`: a refusal becomes an ``ImmediateResponse``
   (Envoy answers the client, nothing goes upstream); an admission becomes a
   ``BodyResponse`` that names the model's cluster (``x-kvfleet-cluster``) and the
   engines to try in order (``x-gateway-destination-endpoint: host:port,host:port``)
   and clears the route cache, so Envoy routes by them;
3. response headers and each streamed body chunk → the admitted request watches
   them go by (usage, first token) and may rewrite a chunk;
4. the response's end, or the stream's end before it → :meth:`Admitted.finish`.

This layer decides nothing: every decision is the :class:`Gate`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import betterproto2
from envoy_data_plane.envoy.config.core.v3 import (
    HeaderMap,
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
)
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    ExternalProcessorBase,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode

from kvfleet.router.gateway.gate import Admitted, Gate, Outcome, Reply
from kvfleet.router.gateway.xds import model_cluster
from kvfleet.router.gateway_config import CLUSTER_HEADER, ENDPOINTS_HEADER, UPSTREAM_HEADER

log = logging.getLogger(__name__)


def header_dict(headers: HeaderMap | None) -> dict[str, str]:
    """Envoy's header map (lower-case keys, values in ``raw_value``) as a dict."""
    if headers is None:
        return {}
    return {h.key: h.raw_value.decode("latin-1") if h.raw_value else h.value for h in headers.headers}


def set_headers(headers: Mapping[str, str], remove: tuple[str, ...] = ()) -> HeaderMutation:
    overwrite = HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(
                header=HeaderValue(key=k, raw_value=v.encode("latin-1")), append_action=overwrite
            )
            for k, v in headers.items()
        ],
        remove_headers=list(remove),
    )


def immediate(reply: Reply) -> ProcessingResponse:
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=StatusCode(reply.status)),
            headers=set_headers(reply.headers),
            body=reply.body,
            details="kvfleet_gateway_reply",
        )
    )


def route_to(admitted: Admitted) -> CommonResponse:
    """Send the request to the admitted engine (and the router's body, when it has one).

    The tenant's key stays at the gateway: engines never see ``authorization`` or ``x-api-key``.
    """
    body = admitted.upstream_body
    headers = {
        **admitted.upstream_headers,
        CLUSTER_HEADER: model_cluster(admitted.model),
        ENDPOINTS_HEADER: ",".join((admitted.engine, *admitted.fallbacks)),
    }
    if body is not None:
        headers["content-length"] = str(len(body))  # Envoy refuses a replaced body of another length
    return CommonResponse(
        header_mutation=set_headers(headers, remove=("authorization", "x-api-key")),
        body_mutation=None if body is None else BodyMutation(body=body),
        clear_route_cache=True,
    )


BeforeRouting = Callable[[Admitted], Awaitable[None]]


class ExtProcServer(ExternalProcessorBase):
    """Answers Envoy's ext_proc streams with the :class:`Gate`'s decisions.

    ``before_routing`` runs between an admission and the answer that routes it (the
    gateway server makes sure Envoy holds the request's cluster by then).
    """

    def __init__(self, gate: Gate, before_routing: BeforeRouting | None = None) -> None:
        self.gate = gate
        self.before_routing = before_routing

    async def process(self, messages: AsyncIterator[ProcessingRequest]) -> AsyncIterator[ProcessingResponse]:
        exchange = _Exchange(self.gate, self.before_routing)
        try:
            async for message in messages:
                response = await exchange.step(message)
                if response is not None:
                    yield response
                if exchange.done:
                    return
        finally:
            if exchange.admitted is not None and not exchange.finished:
                # The stream ended before the response did (the client went away, or the
                # upstream reset): settle anyway, shielded from the cancellation that ended it.
                await asyncio.shield(exchange.finish(complete=False))


class _Exchange:
    """One HTTP request's conversation with Envoy, one message at a time."""

    def __init__(self, gate: Gate, before_routing: BeforeRouting | None = None) -> None:
        self.gate = gate
        self.before_routing = before_routing
        self.headers: dict[str, str] = {}
        self.admitted: Admitted | None = None
        self.status: int | None = None
        self.finished = False
        self.done = False

    async def finish(self, *, complete: bool) -> None:
        if self.admitted is not None and not self.finished:
            self.finished = True
            await self.admitted.finish(Outcome(self.status, complete))

    async def admit(self, body: bytes) -> CommonResponse | ProcessingResponse:
        result = await self.gate.admit(self.headers, body)
        if isinstance(result, Reply):
            self.done = True
            return immediate(result)
        self.admitted = result
        if self.before_routing is not None:
            await self.before_routing(result)
        return route_to(result)

    async def step(self, message: ProcessingRequest) -> ProcessingResponse | None:
        # Invariant: exactly one response per message Envoy sends, of the matching kind.
        kind, _ = betterproto2.which_one_of(message, "request")
        if kind == "request_headers" and message.request_headers is not None:
            self.headers = header_dict(message.request_headers.headers)
            if not message.request_headers.end_of_stream:
                return ProcessingResponse(request_headers=HeadersResponse())
            decided = await self.admit(b"")
            if isinstance(decided, ProcessingResponse):
                return decided
            return ProcessingResponse(request_headers=HeadersResponse(response=decided))
        if kind == "request_body" and message.request_body is not None:
            decided = await self.admit(message.request_body.body)
            if isinstance(decided, ProcessingResponse):
                return decided
            return ProcessingResponse(request_body=BodyResponse(response=decided))
        if kind == "response_headers" and message.response_headers is not None:
            return await self.on_response_headers(message)
        if kind == "response_body" and message.response_body is not None:
            return await self.on_response_body(message)
        if kind == "request_trailers":
            return ProcessingResponse(request_trailers=TrailersResponse())
        if kind == "response_trailers":
            await self.finish(complete=True)
            return ProcessingResponse(response_trailers=TrailersResponse())
        log.warning("ext_proc message of an unexpected kind %r", kind)
        return None

    async def on_response_headers(self, message: ProcessingRequest) -> ProcessingResponse:
        assert message.response_headers is not None
        headers = header_dict(message.response_headers.headers)
        self.status = int(headers.get(":status", "0")) or None
        added: Mapping[str, str] = {}
        if self.admitted is not None:
            added = self.admitted.response_headers(headers)
        if message.response_headers.end_of_stream:
            await self.finish(complete=True)
        mutation = CommonResponse(header_mutation=set_headers(added, remove=(UPSTREAM_HEADER,)))
        return ProcessingResponse(response_headers=HeadersResponse(response=mutation))

    async def on_response_body(self, message: ProcessingRequest) -> ProcessingResponse:
        assert message.response_body is not None
        chunk, end = message.response_body.body, message.response_body.end_of_stream
        replacement = None if self.admitted is None else self.admitted.response_chunk(chunk, end)
        if end:
            await self.finish(complete=True)
        mutation = (
            None if replacement is None else CommonResponse(body_mutation=BodyMutation(body=replacement))
        )
        return ProcessingResponse(response_body=BodyResponse(response=mutation))
