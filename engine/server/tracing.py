"""The engine's spans of each request, from the timeline the core stamps (docs/architecture.md §8, "Tracing").

Where it sits: :func:`install_tracing` (called by :func:`kvfleet.engine.server.app.create_app`)
reads the ``OTEL_*`` variables (:mod:`kvfleet.tracing`); when they leave tracing off it does
nothing at all, and no SDK module is imported. When on, a pure ASGI middleware keeps each
request's W3C ``traceparent`` (sent by any router or gateway) in a context variable,
:func:`kvfleet.engine.server.generation.submit` binds each engine request id to it
(:meth:`EngineTracing.bind`), and an observer wrapping the Prometheus one
(:class:`~kvfleet.engine.client.async_engine.RequestObserver`) writes the spans when the request
finishes: ``engine.request`` (arrival to finish, a child of the caller's span) with
``engine.queue`` (arrival to the first step that computed it), ``engine.prefill`` (to the
first token) and ``engine.decode`` (first to last token), and the events ``first_token`` and
``finish``. The core is another process, so no span is opened inside it: the times are the
request's :class:`~kvfleet.engine.client.request_stream.RequestMetrics`, moved from the monotonic
clock to the wall clock.
"""

from __future__ import annotations

import contextvars
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvfleet.tracing import (
    GEN_AI_FINISH_REASONS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_REQUEST_MAX_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_SYSTEM,
    TRACEPARENT,
    Tracing,
    ns,
    tracing_from_env,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvfleet.engine.client.async_engine import RequestObserver
    from kvfleet.engine.client.request_stream import RequestMetrics

_HEADERS: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "trace_headers", default=None
)
_MAX_BOUND = 16384  # requests bound and not yet finished (an aborted one may never report its end)


class EngineTracing:
    """The tracer, and which engine request belongs to which caller's trace."""

    def __init__(self, tracing: Tracing, model: str, inner: RequestObserver | None) -> None:
        self.tracing, self.model, self.inner = tracing, model, inner
        self._bound: OrderedDict[str, tuple[Any, dict[str, Any]]] = OrderedDict()

    def bind(self, request_id: str, max_tokens: int | None, lora: str | None) -> None:
        """Tie an engine request to the trace of the HTTP request being served (its ``traceparent``)."""
        context = self.tracing.extract(_HEADERS.get() or {})
        attributes = {GEN_AI_REQUEST_MODEL: lora or self.model, GEN_AI_REQUEST_MAX_TOKENS: max_tokens}
        self._bound[request_id] = (context, attributes)
        while len(self._bound) > _MAX_BOUND:
            self._bound.popitem(last=False)

    # -- RequestObserver: the Prometheus observer first, then the spans of a finished request
    def on_first_token(self, m: RequestMetrics) -> None:
        if self.inner is not None:
            self.inner.on_first_token(m)

    def on_tokens(self, m: RequestMetrics, num_new: int, gap: float | None) -> None:
        if self.inner is not None:
            self.inner.on_tokens(m, num_new, gap)

    def on_finished(self, m: RequestMetrics) -> None:
        if self.inner is not None:
            self.inner.on_finished(m)
        bound = self._bound.pop(m.request_id, None)
        if bound is not None:
            self._spans(m, *bound)

    def _spans(self, m: RequestMetrics, context: Any, attributes: dict[str, Any]) -> None:
        from opentelemetry import trace

        wall = time.time() - time.monotonic()  # monotonic → epoch seconds

        def at(t: float | None) -> int | None:
            return None if t is None else ns(t + wall)

        tracer = self.tracing.tracer
        root = tracer.start_span(
            "engine.request", context=context, kind=trace.SpanKind.SERVER, start_time=at(m.arrival_time)
        )
        attributes |= {
            GEN_AI_SYSTEM: "kvfleet",
            GEN_AI_INPUT_TOKENS: m.num_prompt_tokens,
            GEN_AI_OUTPUT_TOKENS: m.num_generation_tokens,
            GEN_AI_FINISH_REASONS: (m.finish_reason or "abort",),
            "kvfleet.engine.request_id": m.request_id,
            "kvfleet.engine.cached_tokens": m.num_cached_tokens,
        }
        root.set_attributes({k: v for k, v in attributes.items() if v is not None})
        inside = trace.set_span_in_context(root)
        steps = (
            ("engine.queue", m.arrival_time, m.scheduled_time),
            ("engine.prefill", m.scheduled_time, m.first_token_time),
            ("engine.decode", m.first_token_time, m.last_token_time),
        )
        for name, start, end in steps:
            if start is not None and end is not None:
                tracer.start_span(name, context=inside, start_time=at(start)).end(
                    end_time=at(max(start, end))
                )
        if m.first_token_time is not None:
            root.add_event("first_token", timestamp=at(m.first_token_time))
        root.add_event(
            "finish",
            {"gen_ai.response.finish_reason": m.finish_reason or "abort"},
            timestamp=at(m.finished_time),
        )
        root.end(end_time=at(m.finished_time))


class _KeepTraceparent:
    """Pure ASGI: the request's ``traceparent``/``tracestate`` headers in a context variable, for ``bind``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            found = {
                k.decode("latin-1"): v.decode("latin-1")
                for k, v in scope["headers"]
                if k in (TRACEPARENT.encode(), b"tracestate")
            }
            _HEADERS.set(found or None)
        await self.app(scope, receive, send)


def install_tracing(app: FastAPI, state: Any) -> None:  # a ServerState (not imported: state.py imports this)
    """Trace the engine's requests when the ``OTEL_*`` variables ask for it; else change nothing."""
    tracing = tracing_from_env("kvfleet-engine")
    if tracing is None:
        return
    state.tracing = EngineTracing(tracing, state.model.name, state.engine.observer)
    state.engine.observer = state.tracing
    app.add_middleware(_KeepTraceparent)  # the app's lifespan shuts the tracer down (exports what is left)
