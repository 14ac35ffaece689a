"""A tiny in-test engine for the proxy's unit tests: the engine HTTP contract (docs/architecture.md §5), scripted.

Integration tests and benches use real ``kvfleet engine --simulate`` processes; this
one only lets a test make an engine hang, die mid-stream or hold requests on a gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvfleet.protocol import EngineLoad
from kvfleet.router.app import build_app
from kvfleet.router.config import RouterConfig
from kvfleet.testing.processes import free_port


@dataclass
class FakeEngine:
    model: str = "tiny"
    tokens: list[str] = field(default_factory=lambda: ["Hel", "lo", " world"])
    mode: str = "ok"  # ok | die | hang | dead (every generation request: 503 engine_dead)
    gate: asyncio.Event | None = None
    load: dict[str, Any] = field(default_factory=dict)
    load_delay_s: float = 0.0  # how long GET /load takes (a busy engine)
    received: list[dict[str, Any]] = field(default_factory=list)
    received_headers: list[dict[str, str]] = field(default_factory=list)
    active: int = 0
    peak: int = 0
    aborted: int = 0

    def load_json(self) -> dict[str, Any]:
        base = {
            "model": self.model,
            "kv_cache_usage": 0.0,
            "num_waiting": 0,
            "num_running": self.active,
            "max_num_seqs": 256,
        }
        return EngineLoad.model_validate({**base, **self.load}).model_dump()

    def app(self) -> FastAPI:
        app = FastAPI()
        app.get("/load")(self.get_load)
        app.post("/v1/completions")(self.handle)
        app.post("/v1/chat/completions")(self.handle)
        app.post("/v1/messages")(self.message)
        return app

    async def receive(self, request: Request) -> dict[str, Any]:
        """The request's JSON body, recorded with its headers (``received``, ``received_headers``)."""
        body: dict[str, Any] = await request.json()
        self.received.append(body)
        self.received_headers.append(dict(request.headers))
        return body

    async def message(self, request: Request) -> Response:
        """Anthropic's ``/v1/messages``: the tokens as one text block, whole or as its stream events."""
        body = await self.receive(request)
        usage = {"input_tokens": 7, "output_tokens": len(self.tokens)}
        head = {"id": "msg_x", "type": "message", "role": "assistant", "model": self.model}
        if not body.get("stream"):
            text = [{"type": "text", "text": "".join(self.tokens)}]
            return JSONResponse({**head, "content": text, "stop_reason": "end_turn", "usage": usage})

        def event(kind: str, **payload: Any) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()

        async def events() -> AsyncIterator[bytes]:
            yield event(
                "message_start", message={**head, "content": [], "usage": {**usage, "output_tokens": 0}}
            )
            yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            for token in self.tokens:
                yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": token})
            yield event("content_block_stop", index=0)
            yield event(
                "message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": len(self.tokens)}
            )
            yield event("message_stop")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def get_load(self) -> dict[str, Any]:
        await asyncio.sleep(self.load_delay_s)
        return self.load_json()

    def _chunk(self, body: dict[str, Any], i: int) -> dict[str, Any]:
        if "messages" in body:
            return {
                "object": "chat.completion.chunk",
                "model": self.model,
                "choices": [{"index": 0, "delta": {"content": self.tokens[i]}, "finish_reason": None}],
            }
        return {
            "object": "text_completion",
            "model": self.model,
            "choices": [{"index": 0, "text": self.tokens[i], "finish_reason": None}],
        }

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": 7,
            "completion_tokens": len(self.tokens),
            "total_tokens": 7 + len(self.tokens),
        }

    async def handle(self, request: Request) -> Response:
        body = await self.receive(request)
        if self.mode == "dead":
            error = {"message": "the engine is not running: core died", "type": "service_unavailable"}
            return JSONResponse({"error": {**error, "param": None, "code": "engine_dead"}}, status_code=503)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.mode == "hang":
                await asyncio.sleep(3600)
        except BaseException:
            self.active -= 1
            raise
        if not body.get("stream"):
            self.active -= 1
            text = "".join(self.tokens)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if "messages" in body
                else {"index": 0, "text": text}
            )
            return JSONResponse(
                {
                    "id": "x",
                    "object": "completion",
                    "model": self.model,
                    "created": 0,
                    "choices": [{**choice, "finish_reason": "stop"}],
                    "usage": self.usage(),
                }
            )
        return StreamingResponse(self.stream(body), media_type="text/event-stream")

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        try:
            for i in range(len(self.tokens)):
                yield f"data: {json.dumps(self._chunk(body, i))}\n\n".encode()
                await asyncio.sleep(0.01)
                if self.mode == "die" and i == 0:
                    raise RuntimeError("engine died")
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'choices': [], 'usage': self.usage()})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.active -= 1


RUNNING: dict[int, uvicorn.Server] = {}


@contextlib.asynccontextmanager
async def served(app: FastAPI, port: int) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1:port for the duration of the block."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", timeout_graceful_shutdown=1)
    )
    RUNNING[port] = server
    task = asyncio.create_task(server.serve())
    for _ in range(3000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        raise RuntimeError(f"server on port {port} did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        RUNNING.pop(port, None)


@contextlib.asynccontextmanager
async def served_router(config: RouterConfig) -> AsyncIterator[str]:
    """A router built from ``config``, served on a free port, yielded once one of its engines is ready."""
    app = build_app(config)
    async with served(app, free_port()) as url:
        fleet = app.state.router.fleet
        for _ in range(1000):
            if any(fleet.is_ready(e) for e in fleet.engines.values()):
                break
            await asyncio.sleep(0.02)
        yield url
