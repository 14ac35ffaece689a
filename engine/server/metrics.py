"""The engine's Prometheus metrics (docs/architecture.md §8), one registry per app.

Where it sits: :class:`ServerMetrics` is the ``RequestObserver`` of the ``AsyncEngine``:
as the engine core's step batches arrive, each request's first token, its tokens and its
end feed the latency histograms (stamped at the core's clock) and the token counters.
Gauges and the engine-side counters (preemptions, prefix cache) are read at scrape time
from the core's latest snapshot of ``Engine.stats()``, so a scrape never waits on the engine. vLLM's names for waiting,
running and KV usage are exported beside ours, so a third-party picker can route here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet.engine.client.request_stream import RequestMetrics
from kvfleet.engine.lora.stats import LoraStats
from kvfleet.engine.outputs import EngineStats

prometheus_client.disable_created_metrics()  # no *_created series: dashboards read rates, as vLLM's do
PREFIX = "kvfleet_engine_"
# 5 ms .. 60 s: first tokens range from a cached short prompt to a long queue.
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    60.0,
)
# 1 ms .. 2 s: one decode step, from a small batch on a fast GPU to a large one under pressure.
TPOT_BUCKETS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.0,
)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """Histograms and counters observed per request; gauges collected from the stats snapshot."""

    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS)
        self.tpot = hist(
            "time_per_output_token_seconds", "Mean time per output token after the first.", TPOT_BUCKETS
        )
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive output tokens.", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last output.", E2E_BUCKETS)
        self.queue = hist(
            "queue_time_seconds", "Arrival to the step that computed the first token.", TTFT_BUCKETS
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of requests that got a first token.",
            labels,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Output tokens generated.", labels, registry=self.registry
        )
        self.finished = Counter(
            PREFIX + "requests_finished",
            "Requests finished, by finish reason (stop, length, abort).",
            labels + ["finish_reason"],
            registry=self.registry,
        )
        self.ignored_fields = Counter(
            PREFIX + "ignored_request_fields",
            "Top-level request fields the engine did not know and ignored (engine/server/unknown_fields.py).",
            labels + ["field"],
            registry=self.registry,
        )
        self.registry.register(_StatsCollector(model, stats))

        # The model's children, looked up once, not a locked dict lookup per token on the hot path.
        self._ttft, self._queue = self.ttft.labels(model), self.queue.labels(model)
        self._itl, self._e2e, self._tpot = (
            self.itl.labels(model),
            self.e2e.labels(model),
            self.tpot.labels(model),
        )
        self._prompt, self._generation = (
            self.prompt_tokens.labels(model),
            self.generation_tokens.labels(model),
        )

    def count_ignored_field(self, field: str) -> None:
        self.ignored_fields.labels(self.model, field).inc()

    # -- RequestObserver (called on the event loop as the core's step batches arrive) --

    def on_first_token(self, m: RequestMetrics) -> None:
        if m.ttft is not None:
            self._ttft.observe(m.ttft)
            self._queue.observe(m.queue_time if m.queue_time is not None else m.ttft)
        self._prompt.inc(m.num_prompt_tokens)

    def on_tokens(self, m: RequestMetrics, num_new: int, gap: float | None) -> None:
        self._generation.inc(num_new)
        if gap is not None:
            self._itl.observe(gap)

    def on_finished(self, m: RequestMetrics) -> None:
        if m.e2e is not None:
            self._e2e.observe(m.e2e)
        if m.tpot is not None:
            self._tpot.observe(m.tpot)
        self.finished.labels(self.model, m.finish_reason or "abort").inc()


class _StatsCollector(Collector):
    """Gauges and engine counters from the latest ``EngineStats`` snapshot, at scrape time."""

    def __init__(self, model: str, stats: Callable[[], EngineStats]) -> None:
        self._model = model
        self._stats = stats

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the names depend on nothing; don't call the engine's stats at registration

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        values = {
            "num_requests_running": ("Sequences in the running batch.", s.num_running),
            "num_requests_waiting": ("Sequences waiting for a slot or blocks.", s.num_waiting),
            "kv_cache_usage_ratio": ("Used KV blocks / all KV blocks (0-1).", s.kv_cache_usage),
            "num_kv_blocks": ("KV blocks in the cache.", s.num_kv_blocks),
        }
        for name, (doc, value) in values.items():
            yield self._gauge(PREFIX + name, doc, value)
        # vLLM's names (model_name label as vLLM has it), read by llm-d / Inference Extension pickers.
        yield self._gauge("vllm:num_requests_running", "vLLM-compatible: running requests.", s.num_running)
        yield self._gauge("vllm:num_requests_waiting", "vLLM-compatible: waiting requests.", s.num_waiting)
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "vLLM-compatible: KV-cache usage, 1 means 100 %.", s.kv_cache_usage
        )
        counters = {
            "preemptions": ("Sequences preempted (recomputed) for lack of KV blocks.", s.num_preemptions),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self._model], float(value))
            yield c
        if s.lora is not None:
            yield from lora_metrics(s.lora)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self._model], float(value))
        return g


def lora_metrics(lora: LoraStats) -> Iterator[Metric]:
    """vLLM's ``vllm:lora_requests_info`` (value: the scrape's unix time, as vLLM sets it) and kvfleet's
    per-adapter counters: requests, prompt and generation tokens, device loads and evictions."""
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "vLLM-compatible: running and waiting adapters (comma-joined) and max_lora.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    info.add_metric([",".join(lora.running), ",".join(lora.waiting), str(lora.max_loras)], time.time())
    yield info
    resident = GaugeMetricFamily("kvfleet:lora_resident", "Adapters resident on the device now.")
    resident.add_metric([], float(len(lora.resident)))
    yield resident
    per_adapter = {
        "kvfleet:lora_requests": ("Requests per LoRA adapter.", lora.requests),
        "kvfleet:lora_loads": ("Adapter loads into a device slot.", lora.loads),
        "kvfleet:lora_evictions": ("Adapter evictions from a device slot.", lora.evictions),
    }
    for name, (doc, counts) in per_adapter.items():
        c = CounterMetricFamily(name, doc, labels=["adapter"])
        for adapter, value in counts.items():
            c.add_metric([adapter], float(value))
        yield c
    tokens = CounterMetricFamily(
        "kvfleet:lora_tokens",
        "Tokens per LoRA adapter (kind: prompt, generation).",
        labels=["adapter", "kind"],
    )
    for kind, counts in (("prompt", lora.prompt_tokens), ("generation", lora.generation_tokens)):
        for adapter, value in counts.items():
            tokens.add_metric([adapter, kind], float(value))
    yield tokens
