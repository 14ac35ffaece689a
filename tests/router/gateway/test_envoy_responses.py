"""The Responses and embeddings APIs through the real Envoy (ext_proc: the router), as the router serves them.

``POST /v1/responses`` and ``POST /v1/embeddings`` are admitted, queued and charged as chat is;
a stored response's ``GET``, cancel and ``DELETE`` go to the one engine its id's tag names
(:mod:`kvfleet.router.responses`), and a follow-up (``previous_response_id``) too. The engines
are the router's scripted in-test engines, taught the two APIs here: what reached each one is the
evidence of where Envoy sent every request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvfleet.openai_api.responses_request import new_response_id
from kvfleet.protocol import HEADER_ENGINE
from kvfleet.router.usage import UsageLog

from ...waiting import wait_until
from ..fakes import FakeEngine
from .stack import ALPHA, Stack, gateway, tenant

pytestmark = pytest.mark.asyncio(loop_scope="module")
VECTORS = [[0.25, -0.5, 1.0], [0.125, 0.75, -1.0]]


@dataclass
class StoringEngine(FakeEngine):
    """A scripted engine with the Responses API (ids tagged with the host it listens at) and embeddings."""

    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)  # "METHOD path" of every stored-response call

    def app(self) -> FastAPI:
        app = super().app()
        app.post("/v1/responses")(self.create)
        app.get("/v1/responses/{rid}")(self.by_id)
        app.delete("/v1/responses/{rid}")(self.by_id)
        app.post("/v1/responses/{rid}/cancel")(self.by_id)
        app.post("/v1/embeddings")(self.embed)
        return app

    async def create(self, request: Request) -> Response:
        body = await self.receive(request)
        host, port = request.scope["server"]
        rid = new_response_id(f"{host}:{port}")
        text = "".join(self.tokens)
        usage = {"input_tokens": 7, "output_tokens": len(self.tokens), "total_tokens": 7 + len(self.tokens)}
        message = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip
        done = {"id": rid, "object": "response", "created_at": 0, "model": self.model, "status": "completed",
                "output": [message], "usage": usage, "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": []}  # fmt: skip
        self.stored[rid] = done
        if not body.get("stream"):
            return JSONResponse(done)

        def event(n: int, kind: str, **payload: Any) -> bytes:
            data = json.dumps({"type": kind, "sequence_number": n, **payload})
            return f"event: {kind}\ndata: {data}\n\n".encode()

        async def events() -> AsyncIterator[bytes]:
            yield event(0, "response.created", response={**done, "status": "in_progress", "output": []})
            for i, token in enumerate(self.tokens):
                yield event(i + 1, "response.output_text.delta", item_id="msg_1", output_index=0,
                            content_index=0, delta=token, logprobs=[])  # fmt: skip
            yield event(len(self.tokens) + 1, "response.completed", response=done)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def by_id(self, rid: str, request: Request) -> Response:
        self.calls.append(f"{request.method} {request.url.path}")
        if rid not in self.stored:
            return JSONResponse({"error": {"message": "no such response", "type": "not_found"}}, 404)
        if request.method == "DELETE":
            del self.stored[rid]
            return JSONResponse({"id": rid, "object": "response", "deleted": True})
        return JSONResponse(self.stored[rid])

    async def embed(self, request: Request) -> Response:
        await self.receive(request)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(VECTORS)]
        return JSONResponse({"object": "list", "model": self.model, "data": data,
                             "usage": {"prompt_tokens": 9, "total_tokens": 9}})  # fmt: skip


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(free_port_module: Callable[[], int]) -> AsyncIterator[Stack]:
    async with gateway(free_port_module, [StoringEngine(), StoringEngine()], [tenant("alpha", ALPHA)]) as s:
        yield s


def holder(stack: Stack, rid: str) -> str:
    return next(at for at, e in stack.engines.items() if rid in e.stored)  # type: ignore[attr-defined]


async def test_a_response_and_its_stream_through_envoy_are_admitted_and_accounted_like_chat(
    stack: Stack,
) -> None:
    m = stack.state.metrics
    generated = m.generation_tokens.labels(model="tiny", tenant="alpha")._value.get()
    client = stack.client()
    plain = await client.responses.create(model="tiny", input="hi", max_output_tokens=5)
    stream = await client.responses.create(model="tiny", input="hi", max_output_tokens=5, stream=True)
    kinds = [e.type async for e in stream]
    assert plain.output_text == "Hello world"
    assert kinds == ["response.created", *["response.output_text.delta"] * 3, "response.completed"]
    await wait_until(
        lambda: m.generation_tokens.labels(model="tiny", tenant="alpha")._value.get() == generated + 6,
        250,
        0.02,
    )
    assert stack.state.quota.in_flight("alpha") == 0
    with pytest.raises(openai.BadRequestError) as bad:
        await client.responses.create(model="tiny", input="hi", max_output_tokens=0)
    assert bad.value.body is not None and bad.value.body["param"] == "max_output_tokens"  # type: ignore[index]


async def test_a_stored_response_is_read_cancelled_and_deleted_on_the_engine_whose_tag_its_id_carries(
    stack: Stack,
) -> None:
    client = stack.client()
    rids = [(await client.responses.create(model="tiny", input=f"hi {i}")).id for i in range(4)]
    for rid in rids:
        at = holder(stack, rid)
        got = await client.responses.with_raw_response.retrieve(rid)
        assert got.headers[HEADER_ENGINE] == at and got.parse().id == rid
        await client.responses.cancel(rid)
        await client.responses.delete(rid)
        calls = stack.engines[at].calls[-3:]  # type: ignore[attr-defined]
        assert calls == [
            f"GET /v1/responses/{rid}",
            f"POST /v1/responses/{rid}/cancel",
            f"DELETE /v1/responses/{rid}",
        ]
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(rids[0])  # deleted on its engine: the engine's own 404
    with pytest.raises(openai.NotFoundError) as gone:
        await client.responses.retrieve("resp_0123456789abcdef_deadbeef")  # a tag no engine of the fleet has
    assert "not in the fleet" in gone.value.message


async def test_a_follow_up_goes_to_the_engine_that_stored_its_predecessor(stack: Stack) -> None:
    client = stack.client()
    first = await client.responses.create(model="tiny", input="hi")
    at = holder(stack, first.id)
    for i in range(4):
        before = len(stack.engines[at].received)
        await client.responses.create(model="tiny", input=f"and then {i}", previous_response_id=first.id)
        assert len(stack.engines[at].received) == before + 1


async def test_embeddings_through_envoy_are_the_engines_vectors_charged_their_prompt_tokens(
    stack: Stack, tmp_path: Path
) -> None:
    stack.state.usage_log = UsageLog(str(tmp_path / "usage.jsonl"))
    answered = stack.counted("alpha", "200")
    try:
        out = await stack.client().embeddings.create(model="tiny", input=["a parcel", "a depot"])
        await wait_until(lambda: stack.counted("alpha", "200") > answered, 250, 0.02)
    finally:
        stack.state.usage_log.close()
        stack.state.usage_log = None
    assert [d.embedding for d in out.data] == VECTORS and out.usage.prompt_tokens == 9
    (record,) = [json.loads(line) for line in (tmp_path / "usage.jsonl").read_text().splitlines()]
    assert (record["tenant"], record["status"], record["prompt_tokens"], record["output_tokens"]) == (
        "alpha", 200, 9, 0
    )  # fmt: skip
    assert record["engine"] in stack.engines
