"""The router's SLI events (issue #32): TTFT judged per streamed request, inter-token latency per gap.

``kvfleet_router_sli_events_total{sli, good}`` feeds the chart's burn-rate rules
(charts/kvfleet/files/prometheus/kvfleet-rules.yaml, tested with promtool in tests/charts).
"""

from __future__ import annotations

from kvfleet.resources import SLOSpec
from kvfleet.router.metrics import RouterMetrics, record_slis, sli_targets


def events(m: RouterMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for metric in m.sli_events.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[(sample.labels["sli"], sample.labels["good"])] = sample.value
    return out


def test_a_late_first_token_is_one_bad_ttft_event_and_each_slow_gap_one_bad_itl_event() -> None:
    m = RouterMetrics()
    record_slis(m, "llama", "acme", (500, 50), ttft_s=0.8, gaps_s=[0.01, 0.02, 0.3, 0.04, 3.1])
    assert events(m) == {("ttft", "true"): 0, ("ttft", "false"): 1, ("itl", "true"): 3, ("itl", "false"): 2}


def test_an_sli_without_a_target_is_not_judged_and_a_judged_one_shows_zero_misses() -> None:
    m = RouterMetrics()
    record_slis(m, "llama", "acme", (None, 50), ttft_s=9.0, gaps_s=[0.01, 0.02])
    assert events(m) == {("itl", "true"): 2, ("itl", "false"): 0}  # the bad series exists, at 0


def test_a_one_token_answer_has_no_gap_to_judge() -> None:
    m = RouterMetrics()
    record_slis(m, "llama", "acme", (500, 50), ttft_s=0.1, gaps_s=[])
    assert events(m) == {("ttft", "true"): 1, ("ttft", "false"): 0}


def test_an_itl_p99_target_is_the_gap_target_where_set_else_the_tpot_target() -> None:
    assert sli_targets(SLOSpec(ttft_ms=500, tpot_ms=50, itl_p99_ms=200)) == (500, 200)
    assert sli_targets(SLOSpec(ttft_ms=500, tpot_ms=50)) == (500, 50)
    assert sli_targets(SLOSpec(itl_p99_ms=200)) == (None, 200)
