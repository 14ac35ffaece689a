"""Every metric the chart's dashboards and rules query exists in what the real processes export.

docs/architecture.md §8: "Dashboards and rules use only names the code exports; a test checks that."
One ``kvfleet engine --simulate`` and one ``kvfleet router`` process (the router's test
launchers) serve a streamed completion and a request over quota; both ``/metrics`` are
scraped and parsed with prometheus-client's own parser. The chart's names come from
:func:`chart_metric_names` (histograms without ``_bucket``/``_sum``/``_count``; recorded
``kvfleet:`` series are the rules' own outputs, not scraped names).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.operator.testing.chart import LORA_METRICS, METRIC_NAME, chart_metric_names, expressions
from kvfleet.testing.processes import SimFlags, lora_flags, router_processes, sim_engines

KEY = "sk-metrics-0123456789"
ADAPTERS = ("sql", "chat")
# The multi-LoRA names (issue #15), agreed between the engine and the simulator: name → labels.
# The real engine's export of them is checked in tests/engine/lora/test_lora_server.py.
LORA_METRIC_LABELS: dict[str, set[str]] = {
    "vllm:lora_requests_info": {"running_lora_adapters", "waiting_lora_adapters", "max_lora"},
    "kvfleet:lora_requests_total": {"adapter"},
    "kvfleet:lora_tokens_total": {"adapter", "kind"},
    "kvfleet:lora_loads_total": {"adapter"},
    "kvfleet:lora_evictions_total": {"adapter"},
    "kvfleet:lora_resident": set(),
}


_SELECTOR = re.compile(rf"\b({METRIC_NAME}?)(?:_bucket|_sum|_count)?\{{([^}}]*)\}}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_NAME = re.compile(rf"\b{METRIC_NAME}")


@dataclass
class Metric:
    type: str
    labels: set[str] = field(default_factory=set)  # of the series scraped (``le`` left out)


def exported(text: str) -> dict[str, Metric]:
    """Metric name → type and labels, as a query names it: counters with ``_total``, histograms bare.

    A labelled metric no request has touched yet still has its ``# TYPE`` line, so it
    counts as exported (its first series, and so its labels, appear with its first event).
    """
    names: dict[str, Metric] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {k for sample in family.samples for k in sample.labels if k != "le"}
        names[name] = Metric(family.type, labels)
    return names


def _base(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def queried_labels() -> dict[str, set[str]]:
    """For each kvfleet_* metric, the labels the chart selects it by or aggregates it by."""
    out: dict[str, set[str]] = {}
    for expr in expressions():
        aggregated = {x.strip() for by in _BY.findall(expr) for x in by.split(",") if x.strip() != "le"}
        for name in {_base(n) for n in _NAME.findall(expr)}:
            out.setdefault(name, set()).update(aggregated)
        for name, matchers in _SELECTOR.findall(expr):
            out.setdefault(_base(name), set()).update(_MATCHER.findall(matchers))
        for name in re.findall(r"label_values\((kvfleet_[a-z0-9_]+)[^,]*,\s*(\w+)\)", expr):
            out.setdefault(name[0], set()).add(name[1])
    return out


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Metric]]]:
    tenants = tmp_path_factory.mktemp("metrics") / "tenants.yaml"
    tenants.write_text(
        yaml.safe_dump({"tenants": [{"tenant": "alice", "apiKey": KEY, "limits": {"requestsPerMinute": 3}}]})
    )
    with sim_engines(1, SimFlags(), lora_flags(ADAPTERS, max_loras=1)) as engines:
        engine_url = engines[0].url
        with router_processes(1, [engine_url], tenants, ["--slo-ttft-ms", "10000"]) as (router_url,):
            drive(router_url)
            yield {
                "engine": exported(httpx.get(engine_url + "/metrics", timeout=10).text),
                "router": exported(settled_metrics(router_url)),
            }


def settled_metrics(router_url: str) -> str:
    """The router's exposition once the stream's accounting (done after its last byte) is in."""
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(router_url + "/metrics", timeout=10).text
        if "kvfleet_router_time_to_first_token_seconds_count{" in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def drive(router_url: str) -> None:
    client = openai.OpenAI(base_url=router_url + "/v1", api_key=KEY, max_retries=0)
    deadline = time.monotonic() + 20
    while not {*ADAPTERS} <= {m.id for m in client.models.list().data} and time.monotonic() < deadline:
        time.sleep(0.05)  # the router reads an engine's adapters just after its first load
    for adapter in ADAPTERS:  # the per-adapter series; one slot, so the second evicts the first
        client.completions.create(model=adapter, prompt="hello", max_tokens=2)
    stream = client.completions.create(
        model="tiny", prompt="hello there", max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    assert [c.usage.completion_tokens for c in stream if c.usage is not None] == [4]
    with pytest.raises(openai.RateLimitError):  # the minute's one request is spent: a rejection
        client.completions.create(model="tiny", prompt="x", max_tokens=1)


def test_every_metric_the_dashboards_and_rules_query_is_exported(
    scraped: dict[str, dict[str, Metric]],
) -> None:
    names = {**scraped["engine"], **scraped["router"]}
    missing = sorted(n for n in chart_metric_names() if n not in names)
    assert missing == []


def test_every_label_the_chart_selects_or_groups_by_is_on_the_scraped_series(
    scraped: dict[str, dict[str, Metric]],
) -> None:
    names = {**scraped["engine"], **scraped["router"]}
    assert set(queried_labels()) == chart_metric_names()  # every queried metric, by some label
    unlabelled = {
        name: sorted(labels - names[name].labels)
        for name, labels in queried_labels().items()
        if labels - names[name].labels
    }
    assert unlabelled == {}


def test_each_part_exports_the_chart_names_of_its_own_prefix(scraped: dict[str, dict[str, Metric]]) -> None:
    for part in ("engine", "router"):
        wanted = {n for n in chart_metric_names() if n.startswith(f"kvfleet_{part}_")}
        assert wanted - set(scraped[part]) == set(), part
        assert len(wanted) >= 10, part
    lora = {n for n in chart_metric_names() if n.startswith(("kvfleet:lora_", "vllm:lora_"))}
    assert lora == LORA_METRICS == set(LORA_METRIC_LABELS)
    assert lora - set(scraped["engine"]) == set()
    assert {n: scraped["engine"][n].labels for n in lora} == LORA_METRIC_LABELS


def test_the_latency_metrics_the_chart_takes_quantiles_of_are_histograms(
    scraped: dict[str, dict[str, Metric]],
) -> None:
    names = {**scraped["engine"], **scraped["router"]}
    latencies = {n for n in chart_metric_names() if n.endswith("_seconds")}
    assert {n: names[n].type for n in latencies} == dict.fromkeys(latencies, "histogram")


def test_the_names_and_labels_are_read_from_an_exposition_as_a_query_names_them() -> None:
    text = (
        '# HELP a_total x\n# TYPE a_total counter\na_total{m="t"} 1.0\n'
        '# HELP b_seconds x\n# TYPE b_seconds histogram\nb_seconds_bucket{le="+Inf",t="u"} 1.0\n'
        "b_seconds_count 1.0\nb_seconds_sum 0.5\n# HELP c x\n# TYPE c gauge\n"
    )
    assert exported(text) == {
        "a_total": Metric("counter", {"m"}),
        "b_seconds": Metric("histogram", {"t"}),
        "c": Metric("gauge", set()),
    }
