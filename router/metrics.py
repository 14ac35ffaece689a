"""The router's Prometheus metrics (docs/architecture.md §8), one registry per app.

Names are the contract with the dashboards and rules; each series is labelled by
model and tenant as the client sees the request. Goodput is
``kvfleet_router_slo_requests_total{met="true"}``: requests that met their
InferenceService's TTFT and TPOT targets; the SLO rules judge TTFT and inter-token latency
apart, from ``kvfleet_router_sli_events_total{sli, good}`` (:func:`record_slis`).

Requests naming a LoRA adapter are counted again by adapter (``kvfleet_router_adapter_*``);
only adapters an engine is configured with get a series, so a client cannot mint label values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from kvfleet.resources import SLOSpec

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
M = TypeVar("M", bound=MetricWrapperBase)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}
        add, mt = self._add, ["model", "tenant"]
        # What became of each request: answered (by code), refused (by reason), queued.
        self.requests = add(Counter, "requests", "Requests answered, by status code", [*mt, "code"])
        self.rejections = add(Counter, "rejections", "Requests refused, by reason", [*mt, "reason"])
        self.queue_depth = add(Gauge, "queue_depth", "Requests waiting", ["model"])
        # Latencies as the client sees them.
        latency, per_token = {"buckets": _LATENCY_BUCKETS}, {"buckets": _TOKEN_LATENCY_BUCKETS}
        self.queue_wait = add(Histogram, "queue_wait_seconds", "Time in the admission queue", mt, **latency)
        self.ttft = add(
            Histogram,
            "time_to_first_token_seconds",
            "Time to first token as the client sees it",
            mt,
            **latency,
        )
        self.tpot = add(
            Histogram,
            "time_per_output_token_seconds",
            "Mean time per output token after the first",
            mt,
            **per_token,
        )
        self.itl = add(
            Histogram, "inter_token_latency_seconds", "Time between streamed chunks", mt, **per_token
        )
        # Tokens the engines reported, and each request's and each SLI event's verdict on its SLO.
        self.prompt_tokens = add(Counter, "prompt_tokens", "Prompt tokens the engines reported", mt)
        self.generation_tokens = add(
            Counter, "generation_tokens", "Completion tokens the engines reported", mt
        )
        self.slo = add(Counter, "slo_requests", "Finished requests by whether they met the SLO", [*mt, "met"])
        self.sli_events = add(
            Counter,
            "sli_events",
            "Service-level-indicator events by whether each met its spec.slo target: sli=ttft, one per "
            "streamed request (its first token within ttftMs); sli=itl, one per inter-token gap (within tpotMs)",
            [*mt, "sli", "good"],
        )
        # Requests and tokens again by LoRA adapter (only adapters an engine is configured with).
        self.adapter_requests = add(
            Counter,
            "adapter_requests",
            "Requests naming a LoRA adapter, by status code",
            ["adapter", "tenant", "code"],
        )
        self.adapter_tokens = add(
            Counter,
            "adapter_tokens",
            "Tokens of requests naming a LoRA adapter (kind: prompt or generation)",
            ["adapter", "tenant", "kind"],
        )
        # Quota charges held on this replica, and usage records the log could not keep.
        self.quota_in_flight = add(
            Gauge,
            "quota_in_flight",
            "Requests holding a quota charge (a concurrency slot) on this replica, not yet settled",
            ["tenant"],
        )
        self.quota_reserved_tokens = add(
            Gauge,
            "quota_reserved_tokens",
            "Tokens charged at admission on this replica and not yet settled with the real usage",
            ["tenant"],
        )
        self.usage_dropped = add(
            Counter, "usage_records_dropped", "Usage records dropped because the usage log's queue was full"
        )
        self.engine_up = add(Gauge, "engine_up", "1 while the engine is ready", ["engine"])

    def _add(self, kind: type[M], name: str, doc: str, labels: Sequence[str] = (), **options: Any) -> M:
        """A ``kvfleet_router_<name>`` metric of ``kind`` in this registry."""
        return kind(f"kvfleet_router_{name}", doc, list(labels), registry=self.registry, **options)

    def child(self, metric: M, *values: str) -> M:
        """``metric.labels(*values)`` (values in label-name order), looked up once per label set:
        ``labels()`` validates and locks on every call, and the request path makes about ten."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found  # type: ignore[return-value]

    def reject(self, model: str, tenant: str, reason: str, code: int) -> None:
        self.child(self.rejections, model, tenant, reason).inc()
        self.child(self.requests, model, tenant, str(code)).inc()


def sli_targets(slo: SLOSpec) -> tuple[int | None, int | None]:
    """(TTFT target, per-gap ITL target) in ms of ``spec.slo``: ``itlP99Ms`` where set (a p99 target is
    a gap target 99% of gaps meet: the SLO's own 99% objective), else ``tpotMs``."""
    return slo.ttft_ms, slo.itl_p99_ms if slo.itl_p99_ms is not None else slo.tpot_ms


def record_slis(
    m: RouterMetrics,
    model: str,
    tenant: str,
    targets: tuple[int | None, int | None],
    ttft_s: float,
    gaps_s: list[float],
) -> None:
    """One streamed request's SLI events against ``targets`` (ttftMs, tpotMs; None: not judged): its
    time to first token, and each of its inter-token gaps (the ITL SLI counts gaps, not requests,
    so one long stall in a long answer spends budget as a user feels it)."""
    ttft_ms, itl_ms = targets
    if ttft_ms is not None:
        _count(m, model, tenant, "ttft", int(ttft_s * 1000 <= ttft_ms), 1)
    if itl_ms is not None and gaps_s:
        _count(m, model, tenant, "itl", sum(1 for gap in gaps_s if gap * 1000 <= itl_ms), len(gaps_s))


def _count(m: RouterMetrics, model: str, tenant: str, sli: str, good: int, events: int) -> None:
    """``good`` of ``events`` met the target; both series exist from the first event on (at 0 where
    none), so the rules' error ratio is 0, not absent, while every event is good."""
    m.child(m.sli_events, model, tenant, sli, "true").inc(good)
    m.child(m.sli_events, model, tenant, sli, "false").inc(events - good)
