"""The engine's HTTP app: ``create_app(state)`` wires the routers, the error bodies and the engine loop's life.

Where it sits: ``kvfleet engine`` (``engine/cli.py``) builds an ``Engine``, wraps it with
:func:`build_state` and serves :func:`create_app` on uvicorn (``engine/server/serve.py``);
tests do the same with a small engine. The lifespan attaches the ``AsyncEngine`` to the
engine core (its own process, or a thread) when the server starts, and shuts the core
down when the server exits.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from kvfleet import __version__
from kvfleet.anthropic_api import AnthropicErrors
from kvfleet.engine.client.async_engine import AsyncEngine
from kvfleet.engine.client.core_client import CoreTransport
from kvfleet.engine.server.errors import install_error_handlers
from kvfleet.engine.server.metrics import ServerMetrics
from kvfleet.engine.server.routes import (
    chat,
    completions,
    embeddings,
    lora,
    messages,
    models,
    ops,
    responses,
    tokenize,
)
from kvfleet.engine.server.state import ServedModel, ServerState
from kvfleet.engine.server.tracing import install_tracing
from kvfleet.engine.server.unknown_fields import IgnoredFields, IgnoreUnknownFields
from kvfleet.engine.tokenizer.base import Tokenizer
from kvfleet.http_guard import DEFAULT_MAX_BODY_BYTES, RequestGuard, document_errors


def build_state(
    core: CoreTransport,
    tokenizer: Tokenizer,
    *,
    name: str,
    max_model_len: int,
    block_size: int,
    max_num_seqs: int,
    runner: str = "generate",
) -> ServerState:
    """The engine core (a process or a thread) behind its asyncio handle, with the metrics observing it."""
    async_engine = AsyncEngine(core)
    metrics = ServerMetrics(name, stats=lambda: async_engine.stats_snapshot)
    async_engine.observer = metrics
    model = ServedModel(name, max_model_len, block_size, max_num_seqs, int(time.time()), runner)
    return ServerState(engine=async_engine, tokenizer=tokenizer, model=model, metrics=metrics)


def create_app(state: ServerState, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app over ``state``; request bodies over ``max_body_bytes`` get a 413 (``kvfleet.http_guard``)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            state.engine.stop()
            if state.tracing is not None:
                state.tracing.tracing.shutdown()

    app = FastAPI(title="kvfleet engine", version=__version__, lifespan=lifespan)
    app.state.kvfleet = state
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes)
    app.add_middleware(IgnoreUnknownFields, report=IgnoredFields(state.metrics.count_ignored_field))
    app.add_middleware(AnthropicErrors)  # /v1/messages errors in Anthropic's shape
    for module in (completions, chat, models, ops, lora, responses, messages, tokenize, embeddings):
        app.include_router(module.router)
    install_tracing(app, state)  # OTEL_* variables; nothing when they leave tracing off
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with its 422 replaced by the 400 OpenAI error body the server really sends."""
    if app.openapi_schema is None:
        app.openapi_schema = document_errors(FastAPI.openapi(app))
    return app.openapi_schema
