"""The ext_proc conversation, message by message: what the router answers Envoy at each step."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)

from kvfleet.router.gateway.extproc import ExtProcServer
from kvfleet.router.gateway.gate import Admitted, Outcome, Reply


@dataclass
class Ticket:
    model: str = "tiny"
    engine: str = "10.0.0.7:8000"
    fallbacks: tuple[str, ...] = ("10.0.0.8:8000", "10.0.0.9:8000")
    upstream_body: bytes | None = None
    upstream_headers: Mapping[str, str] = field(default_factory=dict)
    statuses: list[int] = field(default_factory=list)
    chunks: list[tuple[bytes, bool]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)

    def response_headers(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        self.statuses.append(int(headers[":status"]))
        return {"x-kvfleet-engine": self.engine}

    def response_chunk(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        self.chunks.append((chunk, end_of_stream))
        return chunk.upper() if chunk.startswith(b"shout") else None

    async def finish(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


@dataclass
class ScriptedGate:
    decision: Ticket | Reply
    seen: list[tuple[dict[str, str], bytes]] = field(default_factory=list)

    async def admit(self, headers: Mapping[str, str], body: bytes) -> Admitted | Reply:
        self.seen.append((dict(headers), body))
        return self.decision

    def endpoints(self) -> dict[str, list[str]]:
        return {}


def _headers(pairs: dict[str, str], end_of_stream: bool = False) -> HttpHeaders:
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end_of_stream)


REQUEST = {":method": "POST", ":path": "/v1/completions", "authorization": "Bearer k-1"}
BODY = b'{"model": "tiny", "prompt": "hi"}'


def _exchange(*response: ProcessingRequest) -> list[ProcessingRequest]:
    """What Envoy sends of a conversation: REQUEST's headers, its whole BODY, then ``response``'s messages."""
    return [
        ProcessingRequest(request_headers=_headers(REQUEST)),
        ProcessingRequest(request_body=HttpBody(body=BODY, end_of_stream=True)),
        *response,
    ]


async def _converse(
    gate: ScriptedGate, messages: list[ProcessingRequest], consumed: list[ProcessingRequest] | None = None
) -> list[ProcessingResponse]:
    async def stream() -> AsyncIterator[ProcessingRequest]:
        for m in messages:
            if consumed is not None:
                consumed.append(m)
            yield m

    return [r async for r in ExtProcServer(gate).process(stream())]


def _set(response: ProcessingResponse, kind: str) -> dict[str, str]:
    common = getattr(response, kind).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


ROUTED = {
    "x-kvfleet-cluster": "kvfleet_engines/tiny",
    "x-gateway-destination-endpoint": "10.0.0.7:8000,10.0.0.8:8000,10.0.0.9:8000",
}


async def test_an_admitted_request_goes_to_its_models_cluster_engine_first_without_the_tenants_key() -> None:
    gate = ScriptedGate(Ticket())
    replies = await _converse(
        gate,
        _exchange(),
    )
    assert gate.seen == [(REQUEST, BODY)]
    assert replies[0].request_headers is not None and replies[0].request_headers.response is None
    body = replies[1].request_body
    assert body is not None and body.response is not None
    assert body.response.clear_route_cache is True
    assert body.response.body_mutation is None
    assert _set(replies[1], "request_body") == ROUTED
    assert body.response.header_mutation is not None
    assert body.response.header_mutation.remove_headers == ["authorization", "x-api-key"]


async def test_a_body_the_router_rewrites_goes_upstream_with_its_own_length() -> None:
    rewritten = b'{"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": true}}'
    replies = await _converse(
        ScriptedGate(Ticket(upstream_body=rewritten)),
        _exchange(),
    )
    body = replies[1].request_body
    assert body is not None and body.response is not None and body.response.body_mutation is not None
    assert body.response.body_mutation.body == rewritten
    assert _set(replies[1], "request_body") == {**ROUTED, "content-length": str(len(rewritten))}


async def test_a_refusal_is_an_immediate_response_and_ends_the_conversation() -> None:
    refusal = Reply.error(429, "requests_per_minute", "over the limit", retry_after_s=2.2)
    consumed: list[ProcessingRequest] = []
    replies = await _converse(
        ScriptedGate(refusal),
        _exchange(
            ProcessingRequest(response_headers=_headers({":status": "200"})),
        ),
        consumed,
    )
    assert (len(consumed), len(replies)) == (2, 2)
    immediate = replies[1].immediate_response
    assert immediate is not None and immediate.status is not None
    assert immediate.status.code.value == 429
    assert immediate.body == refusal.body
    assert immediate.headers is not None
    assert {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers} == {
        "content-type": "application/json",
        "retry-after": "3",
    }


async def test_the_response_streams_past_the_ticket_which_is_finished_once_at_its_end() -> None:
    ticket = Ticket()
    replies = await _converse(
        ScriptedGate(ticket),
        _exchange(
            ProcessingRequest(
                response_headers=_headers({":status": "200", "content-type": "text/event-stream"})
            ),
            ProcessingRequest(response_body=HttpBody(body=b"data: 1\n\n")),
            ProcessingRequest(response_body=HttpBody(body=b"shout: 2\n\n")),
            ProcessingRequest(response_body=HttpBody(body=b"", end_of_stream=True)),
        ),
    )
    assert ticket.statuses == [200]
    assert _set(replies[2], "response_headers") == {"x-kvfleet-engine": "10.0.0.7:8000"}
    headers = replies[2].response_headers
    assert (
        headers is not None and headers.response is not None and headers.response.header_mutation is not None
    )
    assert headers.response.header_mutation.remove_headers == [
        "x-kvfleet-upstream"
    ]  # Envoy's, not the client's
    assert ticket.chunks == [(b"data: 1\n\n", False), (b"shout: 2\n\n", False), (b"", True)]
    bodies = [r.response_body for r in replies[3:]]
    assert [b is not None and b.response is None for b in bodies] == [True, False, True]
    assert bodies[1] is not None and bodies[1].response is not None
    assert bodies[1].response.body_mutation is not None
    assert bodies[1].response.body_mutation.body == b"SHOUT: 2\n\n"
    assert ticket.outcomes == [Outcome(status=200, complete=True)]


async def test_a_stream_cut_before_the_response_ended_still_finishes_the_ticket_as_incomplete() -> None:
    ticket = Ticket()
    await _converse(
        ScriptedGate(ticket),
        _exchange(
            ProcessingRequest(response_headers=_headers({":status": "200"})),
            ProcessingRequest(response_body=HttpBody(body=b"data: 1\n\n")),
        ),
    )
    assert ticket.outcomes == [Outcome(status=200, complete=False)]


async def test_a_request_without_a_body_is_admitted_on_its_headers() -> None:
    gate = ScriptedGate(Ticket())
    get = {":method": "GET", ":path": "/v1/models", "authorization": "Bearer k-1"}
    replies = await _converse(gate, [ProcessingRequest(request_headers=_headers(get, end_of_stream=True))])
    assert gate.seen == [(get, b"")]
    assert _set(replies[0], "request_headers") == ROUTED
    assert replies[0].request_headers is not None and replies[0].request_headers.response is not None
    assert replies[0].request_headers.response.clear_route_cache is True


async def test_a_response_without_a_body_finishes_the_ticket_on_its_headers() -> None:
    ticket = Ticket()
    await _converse(
        ScriptedGate(ticket),
        _exchange(
            ProcessingRequest(response_headers=_headers({":status": "204"}, end_of_stream=True)),
        ),
    )
    assert ticket.outcomes == [Outcome(status=204, complete=True)]
