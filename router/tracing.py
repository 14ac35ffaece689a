"""The router's spans of one request (docs/architecture.md §8, "Tracing").

Where it sits: :func:`kvfleet.router.pipeline.admit` opens a :class:`RequestTrace` when the
process traces (``RouterState.tracing``, from :func:`kvfleet.tracing.tracing_from_env`; None
when off, and then nothing here runs). It continues the client's W3C ``traceparent`` or starts
a trace. The pipeline marks the end of each step (authentication, quota, admission queue, engine
pick); the transports open the proxied call's span before sending (the HTTP relay, or the ext_proc
answer routing Envoy) and forward its ``traceparent`` to the engine, whose own spans become its
children. :meth:`RequestTrace.finish` (from :meth:`Exchange.finish <kvfleet.router.accounting.Exchange.finish>`,
exactly once) writes the step spans from the marked times, the GenAI attributes, and ends the
root span. Spans name the tenant and the engine, never a key or a prompt.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kvfleet.tracing import (
    GEN_AI_FINISH_REASONS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_REQUEST_MAX_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_SYSTEM,
    KVFLEET_ENGINE,
    KVFLEET_TENANT,
    Tracing,
    ns,
)

AUTHENTICATED, CHECKED, QUOTA, PLACED = "authenticated", "checked", "quota", "placed"


class RequestTrace:
    """One request's root span and the times its steps ended (``time.time()`` seconds)."""

    def __init__(self, tracing: Tracing, headers: Mapping[str, str], name: str) -> None:
        from opentelemetry import trace

        self._trace, self.tracing = trace, tracing
        self.start = time.time()
        self.marks: dict[str, float] = {}
        self.pick_s = 0.0
        self.root = tracing.tracer.start_span(
            name, context=tracing.extract(headers), kind=trace.SpanKind.SERVER, start_time=ns(self.start)
        )
        self.proxy: Any = None
        self.headers: dict[str, str] = {}  # the traceparent the engine gets
        self.ended = False

    @property
    def trace_id(self) -> str:
        return f"{self.root.get_span_context().trace_id:032x}"

    def mark(self, step: str) -> None:
        self.marks[step] = time.time()

    def start_proxy(self, engine: str) -> dict[str, str]:
        """Open the proxied call's span (once); the headers that make it the engine's parent."""
        if self.proxy is None:
            self.proxy = self._child("proxy", time.time(), kind=self._trace.SpanKind.CLIENT)
            self.proxy.set_attribute(KVFLEET_ENGINE, engine)
            self.headers = self.tracing.inject(self.proxy)
        return self.headers

    def _child(self, name: str, start: float, kind: Any = None) -> Any:
        context = self._trace.set_span_in_context(self.root)
        kind = kind if kind is not None else self._trace.SpanKind.INTERNAL
        return self.tracing.tracer.start_span(name, context=context, kind=kind, start_time=ns(start))

    def _step(self, name: str, start: float | None, end: float | None, **attributes: Any) -> None:
        if start is None or end is None:
            return
        span = self._child(name, start)
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(key, value)
        span.end(end_time=ns(max(start, end)))

    def _steps(self) -> None:
        m = self.marks
        self._step("authenticate", self.start, m.get(AUTHENTICATED))
        self._step("quota", m.get(CHECKED), m.get(QUOTA))
        placed = m.get(PLACED)
        picked = None if placed is None else placed - self.pick_s
        self._step("admission_queue", m.get(QUOTA), picked)
        self._step("engine_pick", picked, placed)

    def finish(
        self,
        attributes: dict[str, Any],
        status: int,
        reason: str | None,
        first_token_ago_s: float | None = None,
    ) -> None:
        """Write the step spans, set the attributes, end the proxied call's span and the root (once);
        ``first_token_ago_s``: how long ago the client was sent the first token (an event on the root)."""
        if self.ended:
            return
        self.ended = True
        self._steps()
        if first_token_ago_s is not None:
            self.root.add_event("first_token", timestamp=ns(time.time() - first_token_ago_s))
        end = ns(time.time())
        for span in (self.proxy, self.root):
            if span is None:
                continue
            for key, value in attributes.items():
                if value is not None:
                    span.set_attribute(key, value)
            span.set_attribute("http.response.status_code", status)
            if status >= 500 or (reason is not None and status != 499 and status >= 400):
                span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, reason or str(status)))
            span.end(end_time=end)


def genai_attributes(
    *,
    model: str,
    tenant: str,
    engine: str | None,
    max_tokens: int,
    usage: tuple[int, int] | None,
    finish_reason: str | None,
    operation: str,
) -> dict[str, Any]:
    """The GenAI semantic-convention attributes (and kvfleet's) of a settled request."""
    return {
        GEN_AI_SYSTEM: "kvfleet",
        GEN_AI_OPERATION: operation,
        GEN_AI_REQUEST_MODEL: model,
        GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
        GEN_AI_INPUT_TOKENS: None if usage is None else usage[0],
        GEN_AI_OUTPUT_TOKENS: None if usage is None else usage[1],
        GEN_AI_FINISH_REASONS: None if finish_reason is None else (finish_reason,),
        KVFLEET_TENANT: tenant,
        KVFLEET_ENGINE: engine,
    }
