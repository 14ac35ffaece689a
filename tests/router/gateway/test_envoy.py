"""Client → the real Envoy → (ext_proc: the router's gate) → engine, end to end on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import httpx
import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvfleet.router.gateway import xds
from kvfleet.router.gateway.ads import AdsServer
from kvfleet.router.gateway.config import GatewayConfig
from kvfleet.router.gateway.gate import Admitted, Outcome, Reply
from kvfleet.router.gateway.process import EnvoyProcess
from kvfleet.router.gateway.server import serve

pytestmark = pytest.mark.asyncio(loop_scope="module")


def engine_app(name: str, seen: list[dict[str, object]]) -> FastAPI:
    """A minimal OpenAI-shaped upstream that says who it is."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        seen.append({"body": body, "headers": dict(request.headers)})
        if not body.get("stream"):
            return JSONResponse({"engine": name, "choices": [{"text": "ok"}], "usage": {"total_tokens": 3}})

        async def events() -> AsyncIterator[str]:
            for i in range(3):
                yield f"data: {json.dumps({'engine': name, 'choices': [{'text': str(i)}]})}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@dataclass
class Ticket:
    engine: str
    chunks: list[bytes] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    upstream_body: bytes | None = None

    def response_headers(self, status: int) -> Mapping[str, str]:
        return {"x-kvfleet-engine": self.engine}

    def response_chunk(self, chunk: bytes, end_of_stream: bool) -> bytes | None:
        self.chunks.append(chunk)
        return None

    async def finish(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


@dataclass
class BudgetGate:
    """Keys → tenants, a request budget per tenant, and the engine to send to."""

    engine: str = ""
    budget: dict[str, int] = field(default_factory=dict)
    tickets: list[Ticket] = field(default_factory=list)

    async def admit(self, headers: Mapping[str, str], body: bytes) -> Admitted | Reply:
        tenant = {"Bearer key-alpha": "alpha"}.get(headers.get("authorization", ""))
        if tenant is None:
            return Reply.error(401, "invalid_api_key", "invalid API key")
        if self.budget.get(tenant, 1) <= 0:
            return Reply.error(429, "requests_per_minute", "over requestsPerMinute=1", retry_after_s=41.5)
        self.budget[tenant] = self.budget.get(tenant, 1) - 1
        ticket = Ticket(self.engine)
        self.tickets.append(ticket)
        return ticket


@dataclass
class Stack:
    envoy: EnvoyProcess
    ads: AdsServer
    gate: BudgetGate
    engines: dict[str, str]  # name -> host:port
    seen: dict[str, list[dict[str, object]]]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(free_port_module: Callable[[], int]) -> AsyncIterator[Stack]:
    seen: dict[str, list[dict[str, object]]] = {"a": [], "b": []}
    servers, engines = [], {}
    for name in seen:
        port = free_port_module()
        config = uvicorn.Config(
            engine_app(name, seen[name]), host="127.0.0.1", port=port, log_level="warning"
        )
        servers.append(uvicorn.Server(config))
        engines[name] = f"127.0.0.1:{port}"
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    gate = BudgetGate()
    config = GatewayConfig(
        xds_port=free_port_module(), listen_port=free_port_module(), admin_port=free_port_module()
    )
    try:
        async with serve(gate, config) as ads:
            envoy = EnvoyProcess(config)
            await asyncio.to_thread(envoy.start)
            try:
                yield Stack(envoy, ads, gate, engines, seen)
            finally:
                await asyncio.to_thread(envoy.stop)
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks)


async def test_envoy_acknowledges_the_routers_listeners_and_clusters(stack: Stack) -> None:
    assert stack.ads.acked == {xds.CLUSTER_TYPE: stack.ads.version, xds.LISTENER_TYPE: stack.ads.version}
    assert stack.ads.rejected == {}


async def test_an_admitted_request_reaches_the_engine_the_gate_chose_without_the_key(stack: Stack) -> None:
    stack.gate.engine, stack.gate.budget = stack.engines["b"], {"alpha": 5}
    before = len(stack.seen["a"])
    async with httpx.AsyncClient(base_url=stack.envoy.url) as client:
        r = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "hi"},
            headers={"authorization": "Bearer key-alpha"},
        )
    assert r.status_code == 200
    assert r.json()["engine"] == "b"
    assert r.headers["x-kvfleet-engine"] == stack.engines["b"]
    assert len(stack.seen["a"]) == before
    assert stack.seen["b"][-1]["body"] == {"model": "tiny", "prompt": "hi"}
    assert "authorization" not in stack.seen["b"][-1]["headers"]
    assert stack.gate.tickets[-1].outcomes == [Outcome(status=200, complete=True)]
    assert json.loads(b"".join(stack.gate.tickets[-1].chunks))["engine"] == "b"


async def test_a_bad_key_is_answered_401_by_envoy_and_reaches_no_engine(stack: Stack) -> None:
    before = {name: len(s) for name, s in stack.seen.items()}
    async with httpx.AsyncClient(base_url=stack.envoy.url) as client:
        r = await client.post(
            "/v1/completions", json={"model": "tiny"}, headers={"authorization": "Bearer nope"}
        )
    assert r.status_code == 401
    assert r.json() == {
        "error": {
            "message": "invalid API key",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert {name: len(s) for name, s in stack.seen.items()} == before


async def test_a_tenant_over_its_limit_gets_429_with_retry_after_before_any_upstream_work(
    stack: Stack,
) -> None:
    stack.gate.engine, stack.gate.budget = stack.engines["a"], {"alpha": 0}
    before = {name: len(s) for name, s in stack.seen.items()}
    async with httpx.AsyncClient(base_url=stack.envoy.url) as client:
        r = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "x"},
            headers={"authorization": "Bearer key-alpha"},
        )
    assert (r.status_code, r.headers["retry-after"]) == (429, "42")
    assert r.json()["error"]["code"] == "requests_per_minute"
    assert {name: len(s) for name, s in stack.seen.items()} == before


async def test_server_sent_events_pass_through_envoy_event_by_event(stack: Stack) -> None:
    stack.gate.engine, stack.gate.budget = stack.engines["a"], {"alpha": 5}
    events: list[str] = []
    async with (
        httpx.AsyncClient(base_url=stack.envoy.url) as client,
        client.stream(
            "POST",
            "/v1/completions",
            json={"model": "tiny", "prompt": "x", "stream": True},
            headers={"authorization": "Bearer key-alpha"},
        ) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["0", "1", "2"]
    assert {json.loads(e)["engine"] for e in events[:-1]} == {"a"}
    ticket = stack.gate.tickets[-1]
    assert ticket.outcomes == [Outcome(status=200, complete=True)]
    assert b"".join(ticket.chunks).count(b"data: ") == 4
