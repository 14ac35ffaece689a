"""What every route of the engine server shares: the async engine, the tokenizer, the model, the drain state.

Where it sits: ``engine/server/app.py`` builds one :class:`ServerState` per app and hands
it to the routers through the ``State`` dependency; ``engine/server/serve.py`` flips
``draining`` on SIGTERM and waits on :attr:`ServerState.in_flight` to reach zero.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from kvfleet.engine.client.async_engine import AsyncEngine
from kvfleet.engine.outputs import EngineStats
from kvfleet.engine.server.metrics import ServerMetrics
from kvfleet.engine.server.response_store import ResponseStore
from kvfleet.engine.tokenizer.base import Tokenizer
from kvfleet.openai_api import APIError, model_not_found
from kvfleet.streaming import DEFAULT_STALL_TIMEOUT_S

if TYPE_CHECKING:
    from kvfleet.engine.server.tracing import EngineTracing


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients send as "model"
    max_model_len: int  # prompt + completion tokens one sequence may hold
    block_size: int
    max_num_seqs: int
    created: int  # unix time the server started (the /v1/models "created")
    runner: str = "generate"  # --runner: "pooling" serves /v1/embeddings and no generation route


class InFlight:
    """Counts the generation requests being served; ``wait_idle`` returns once none are."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def exit(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    @asynccontextmanager
    async def track(self) -> AsyncIterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.exit()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


@dataclass(frozen=True)
class ToolSettings:
    """How the server reads the model's output: tool calls (``--tool-call-parser``,
    ``--enable-auto-tool-choice``) and reasoning (``--reasoning-parser``)."""

    parser: str | None = None  # the parser of tool_choice "auto"
    auto: bool = False  # whether tool_choice "auto" is served
    reasoning_parser: str | None = None  # None: the output has no reasoning apart


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model: ServedModel
    metrics: ServerMetrics
    ready: bool = False  # true once the engine loop runs; false again while draining
    draining: bool = False
    in_flight: InFlight = field(default_factory=InFlight)
    stream_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S  # a client reading nothing this long: aborted
    tools: ToolSettings = field(default_factory=ToolSettings)
    tracing: EngineTracing | None = None  # the OTEL_* variables turned tracing on (engine/server/tracing.py)
    responses: ResponseStore = field(default_factory=ResponseStore)  # POST /v1/responses's store: true

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats_snapshot

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters the core knows (name → path), as of its latest stats."""
        lora = self.stats.lora
        return {} if lora is None else lora.known

    def check_accepting(self, model: str) -> str | None:
        """Raise the APIError a new generation request gets now (503 draining, 404 unknown model);
        else the LoRA adapter the request names (None: the base model)."""
        if self.draining:
            raise APIError(
                503,
                "the engine is draining (shutting down); retry on another replica",
                type="service_unavailable",
                code="draining",
                headers={"Retry-After": "1"},
            )
        if not self.engine.is_running:
            raise APIError(
                503,
                f"the engine is not running: {self.engine.dead_reason or 'stopped'}",
                type="service_unavailable",
                code="engine_dead",
                headers={"Retry-After": "5"},
            )
        if model == self.model.name:
            return None
        if model in self.adapters:
            return model
        raise model_not_found(model, self.model.name)

    def check_generating(self, model: str) -> str | None:
        """:meth:`check_accepting` for a generation route: a pooling engine refuses it (400 naming model)."""
        lora = self.check_accepting(model)
        if self.model.runner == "pooling":
            raise APIError(
                400,
                f"model: {self.model.name!r} is served with --runner pooling: it serves POST /v1/embeddings "
                "only, and generates no text",
                param="model",
            )
        return lora


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvfleet
    return state


State = Annotated[ServerState, Depends(get_state)]
