"""The router's Prometheus metrics (docs/architecture.md §8), one registry per app.

Names are the contract with the dashboards and rules; each series is labelled by
model and tenant as the client sees the request. Goodput is
``kvfleet_router_slo_requests_total{met="true"}``: requests that met their
InferenceService's TTFT and TPOT targets. Requests naming a LoRA adapter are counted
again by adapter (``kvfleet_router_adapter_*``); only adapters an engine is configured with
get a series, so a client cannot mint label values.
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
M = TypeVar("M", bound=MetricWrapperBase)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}
        mt = ["model", "tenant"]
        self.requests = Counter(
            "kvfleet_router_requests", "Requests answered, by status code", [*mt, "code"], registry=r
        )
        self.rejections = Counter(
            "kvfleet_router_rejections", "Requests refused, by reason", [*mt, "reason"], registry=r
        )
        self.queue_depth = Gauge("kvfleet_router_queue_depth", "Requests waiting", ["model"], registry=r)
        self.queue_wait = Histogram(
            "kvfleet_router_queue_wait_seconds",
            "Time in the admission queue",
            mt,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvfleet_router_time_to_first_token_seconds",
            "Time to first token as the client sees it",
            mt,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvfleet_router_time_per_output_token_seconds",
            "Mean time per output token after the first",
            mt,
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvfleet_router_inter_token_latency_seconds",
            "Time between streamed chunks",
            mt,
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvfleet_router_prompt_tokens", "Prompt tokens the engines reported", mt, registry=r
        )
        self.generation_tokens = Counter(
            "kvfleet_router_generation_tokens", "Completion tokens the engines reported", mt, registry=r
        )
        self.slo = Counter(
            "kvfleet_router_slo_requests",
            "Finished requests by whether they met the SLO",
            [*mt, "met"],
            registry=r,
        )
        self.adapter_requests = Counter(
            "kvfleet_router_adapter_requests",
            "Requests naming a LoRA adapter, by status code",
            ["adapter", "tenant", "code"],
            registry=r,
        )
        self.adapter_tokens = Counter(
            "kvfleet_router_adapter_tokens",
            "Tokens of requests naming a LoRA adapter (kind: prompt or generation)",
            ["adapter", "tenant", "kind"],
            registry=r,
        )
        self.quota_in_flight = Gauge(
            "kvfleet_router_quota_in_flight",
            "Requests holding a quota charge (a concurrency slot) on this replica, not yet settled",
            ["tenant"],
            registry=r,
        )
        self.quota_reserved_tokens = Gauge(
            "kvfleet_router_quota_reserved_tokens",
            "Tokens charged at admission on this replica and not yet settled with the real usage",
            ["tenant"],
            registry=r,
        )
        self.usage_dropped = Counter(
            "kvfleet_router_usage_records_dropped",
            "Usage records dropped because the usage log's queue was full",
            registry=r,
        )
        self.engine_up = Gauge(
            "kvfleet_router_engine_up", "1 while the engine is ready", ["engine"], registry=r
        )

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
