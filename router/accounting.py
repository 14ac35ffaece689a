"""One request's bookkeeping, from quota charge to settlement (docs/architecture.md §6, §8).

An :class:`Exchange` watches the response go by (SSE events or a JSON body), times the
first token and the gaps between chunks as the client sees them, keeps the usage the
engine reported, and on :meth:`Exchange.finish`, exactly once: frees the engine,
settles the quota (real usage; a refund when the fleet failed), corrects the tenant's
virtual token counter, and records the metrics, including whether the request met
its service's SLO (goodput).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from kvfleet.router import anthropic, responses, tokenize
from kvfleet.router.errors import RouterError
from kvfleet.router.fleet import Placement
from kvfleet.router.metrics import record_slis, sli_targets
from kvfleet.router.quota import Charge, QuotaUnavailable
from kvfleet.router.requests import CHAT, RESPONSES, ParsedRequest
from kvfleet.router.tenants import Tenant
from kvfleet.router.tracing import RequestTrace, genai_attributes
from kvfleet.router.usage import seconds
from kvfleet.sse import DONE, event_data

if TYPE_CHECKING:
    from kvfleet.router.state import RouterState

log = logging.getLogger(__name__)

_OPERATIONS = {CHAT: "chat", RESPONSES: "chat", "/v1/embeddings": "embeddings"}  # GenAI semconv names


def _has_content(obj: dict[str, Any]) -> bool:
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and delta.get("content")):
            return True
    return False


def finish_reason(obj: dict[str, Any]) -> str | None:
    """The first finish reason among a chunk's (or a whole response's) choices."""
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
            return str(choice["finish_reason"])
    return None


@dataclass
class Exchange:
    state: RouterState
    tenant: Tenant
    req: ParsedRequest
    prompt_estimate: int
    _charge: Charge | None = field(default=None, repr=False)
    placement: Placement | None = None
    started: float = field(default_factory=time.perf_counter)
    first_at: float | None = None
    last_at: float | None = None
    content_chunks: int = 0
    usage: dict[str, Any] | None = None
    saw_done: bool = False
    settled: bool = False
    gaps: list[float] = field(default_factory=list)  # between content chunks, for the ITL histogram
    queue_wait_s: float | None = None  # time in the admission queue (None: placed without queueing)
    finish_reason: str | None = None  # the first choice's, as the engine sent it
    trace: RequestTrace | None = None  # the request's spans, when the router traces (kvfleet.router.tracing)

    @property
    def charge(self) -> Charge | None:
        """The quota taken at admission; until :meth:`finish` settles it, it shows in the replica's
        ``kvfleet_router_quota_in_flight`` and ``..._reserved_tokens`` gauges (0 when all is settled)."""
        return self._charge

    @charge.setter
    def charge(self, charge: Charge) -> None:
        assert self._charge is None, "a request is charged once"
        self._charge = charge
        self._held(charge, +1)

    def _held(self, charge: Charge, sign: int) -> None:
        m = self.state.metrics
        m.child(m.quota_in_flight, charge.tenant).inc(sign)
        m.child(m.quota_reserved_tokens, charge.tenant).inc(sign * charge.tokens)

    def on_event(self, event: bytes) -> bytes | None:
        """Observe one SSE event; return what to send on (None: drop it)."""
        payload = event_data(event)
        if payload is None:
            return event
        if payload == DONE:
            self.saw_done = True
            return event
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event
        if not isinstance(obj, dict):
            return event
        if self.req.path == RESPONSES:
            self._on_responses_event(responses.read_event(obj))
            return event
        if self.req.path in anthropic.PATHS:
            return self._on_anthropic(event, obj)
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
            if not obj.get("choices") and not self.req.client_wants_usage:
                return None  # the usage chunk the router asked for, not the client
        if self.finish_reason is None:
            self.finish_reason = finish_reason(obj)
        if _has_content(obj):
            self._content()
        return event

    def _on_responses_event(self, got: responses.ResponsesEvent) -> None:
        if got.done:
            self.saw_done, self.usage, self.finish_reason = True, got.usage, got.status
        if got.content:
            self._content()

    def _on_anthropic(self, event: bytes, obj: dict[str, Any]) -> bytes:
        """One event of an Anthropic stream (kvfleet.router.anthropic): its usage, stop reason and content."""
        self.usage = anthropic.stream_usage(obj, self.usage)
        self.saw_done = self.saw_done or obj.get("type") == anthropic.STOP_EVENT
        self.finish_reason = self.finish_reason or anthropic.stop_reason(obj)
        if anthropic.is_content(obj):
            self._content()
        return event

    def _content(self) -> None:
        now = time.perf_counter()
        if self.first_at is None:
            self.first_at = now
        elif self.last_at is not None:
            self.gaps.append(now - self.last_at)  # observed once, at the end
        self.last_at = now
        self.content_chunks += 1

    def on_whole(self, body: Any) -> None:
        """Observe a whole (non-streamed) JSON response: its usage and finish reason."""
        if self.req.path == RESPONSES and isinstance(body, dict):  # Responses: input/output tokens, status
            self.usage, self.finish_reason = responses.chat_usage(body.get("usage")), body.get("status")
            return
        usage = body.get("usage") if isinstance(body, dict) else None
        self.usage = usage if isinstance(usage, dict) else None
        if isinstance(body, dict):
            self.finish_reason = finish_reason(body)
        if isinstance(body, dict) and self.req.path in tokenize.PATHS:
            self.usage = tokenize.whole_usage(self.req.path, body, self.req.body)
        if isinstance(body, dict) and self.req.path in anthropic.PATHS:
            self.usage = anthropic.whole_usage(body)
            self.finish_reason = anthropic.stop_reason(body)

    def completion_tokens(self) -> int:
        if self.usage is not None:
            return int(self.usage.get("completion_tokens") or 0)
        return self.content_chunks

    def prompt_tokens(self) -> int:
        if self.usage is not None:
            return int(self.usage.get("prompt_tokens") or 0)
        return self.prompt_estimate

    def used_tokens(self) -> int:
        return self.prompt_tokens() + self.completion_tokens()

    def cut_off_error(self) -> RouterError:
        return RouterError(502, "engine_failed", "the engine stopped before the response was complete")

    def cut_off_events(self) -> bytes:
        """What ends a stream the engine cut off: an error event in the route's own shape."""
        err = self.cut_off_error()
        if self.req.path in anthropic.PATHS:
            return anthropic.error_event(err.status, err.message)
        return err.sse() + b"data: [DONE]\n\n"

    async def engine_failed(self) -> None:
        if self.placement is not None:
            self.state.fleet.mark_failed(self.placement.url)
        await self.finish(502, used=None, reason="engine_failed")

    async def finish(self, code: int, *, used: int | None, reason: str | None) -> None:
        if self.settled:
            return
        self.settled = True
        try:
            await self._settle(code, used, reason)
        finally:  # one usage record per settled request, on every path (kvfleet.router.usage)
            if self.state.usage_log is not None:
                self.state.usage_log.write(self.usage_record(code, reason))
            if self.trace is not None:
                first = None if self.first_at is None else time.perf_counter() - self.first_at
                self.trace.finish(self._span_attributes(), code, reason, first)

    async def _settle(self, code: int, used: int | None, reason: str | None) -> None:
        state, model, tenant = self.state, self.req.model, self.tenant.name
        if self.placement is not None:
            state.fleet.release(self.placement)
        if self._charge is not None:
            self._held(self._charge, -1)
            try:
                await state.quota.settle(self._charge, self.tenant.spec.limits, used)
            except QuotaUnavailable:
                log.warning("could not settle a request of tenant %s: quota store unavailable", tenant)
        if state.fleet.is_adapter(model):
            state.metrics.child(state.metrics.adapter_requests, model, tenant, str(code)).inc()
        if reason is not None and self.placement is None and code != 499:
            state.metrics.reject(model, tenant, reason, code)
            return
        state.metrics.child(state.metrics.requests, model, tenant, str(code)).inc()
        if code == 200:
            self._record_success()

    def usage_record(self, status: int, reason: str | None) -> dict[str, Any]:
        """The usage log's record of this request (tokens of a 200 are the ones the metrics count)."""
        state, req = self.state, self.req
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")
        return {
            "time": round(state.clock(), 3),
            "tenant": self.tenant.name,
            "model": req.model,
            "adapter": req.model if state.fleet.is_adapter(req.model) else None,
            "engine": urlsplit(self.placement.url).netloc if self.placement is not None else None,
            "stream": req.stream,
            "prompt_tokens": self.prompt_tokens() if status == 200 or self.usage is not None else 0,
            "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None,
            "output_tokens": self.completion_tokens(),
            "queue_wait_s": seconds(self.queue_wait_s),
            "ttft_s": seconds(None if self.first_at is None else self.first_at - self.started),
            "duration_s": seconds(time.perf_counter() - self.started),
            "status": status,
            "reason": reason,
            "finish_reason": self.finish_reason,
            "trace_id": None if self.trace is None else self.trace.trace_id,
        }

    def _span_attributes(self) -> dict[str, Any]:
        return genai_attributes(
            model=self.req.model,
            tenant=self.tenant.name,
            engine=urlsplit(self.placement.url).netloc if self.placement is not None else None,
            max_tokens=self.req.max_tokens,
            usage=(self.prompt_tokens(), self.completion_tokens()) if self.placement is not None else None,
            finish_reason=self.finish_reason,
            operation=_OPERATIONS.get(urlsplit(self.req.path).path, "text_completion"),
        )

    def _record_success(self) -> None:
        state, model, tenant = self.state, self.req.model, self.tenant.name
        m = state.metrics
        prompt, completion = self.prompt_tokens(), self.completion_tokens()
        m.child(m.prompt_tokens, model, tenant).inc(prompt)
        m.child(m.generation_tokens, model, tenant).inc(completion)
        if state.fleet.is_adapter(model):
            m.child(m.adapter_tokens, model, tenant, "prompt").inc(prompt)
            m.child(m.adapter_tokens, model, tenant, "generation").inc(completion)
        queue = state.queues.get(model)
        if queue is not None:
            queue.vtc.charge(tenant, prompt - self.prompt_estimate + completion, self.tenant.spec.weight)
        end = time.perf_counter()
        ttft = (self.first_at if self.first_at is not None else end) - self.started
        tpot = (end - ttft - self.started) / (completion - 1) if completion > 1 else 0.0
        if self.req.stream:
            itl = m.child(m.itl, model, tenant)
            for gap in self.gaps:
                itl.observe(gap)
            m.child(m.ttft, model, tenant).observe(ttft)
            if completion > 1:
                m.child(m.tpot, model, tenant).observe(tpot)
        service = state.fleet.service_for(model)
        slo = service.slo if service is not None else state.config.slo
        if self.req.stream:
            record_slis(m, model, tenant, sli_targets(slo), ttft, self.gaps)
        if slo.ttft_ms is None and slo.tpot_ms is None:  # goodput judges TTFT and TPOT only
            return
        if self.req.stream:
            met = (slo.ttft_ms is None or ttft * 1000 <= slo.ttft_ms) and (
                slo.tpot_ms is None or tpot * 1000 <= slo.tpot_ms
            )
        else:  # no first token to see: the whole response within the budget of both targets
            budget = (slo.ttft_ms or 0.0) + (slo.tpot_ms or 0.0) * max(0, completion - 1)
            met = (end - self.started) * 1000 <= budget
        m.child(m.slo, model, tenant, "true" if met else "false").inc()
