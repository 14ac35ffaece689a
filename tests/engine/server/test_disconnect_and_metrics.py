"""A client that goes away frees its blocks; the metrics of docs/architecture.md §8 count what happened, exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from conftest import LiveServer


def _samples(live: LiveServer) -> dict[str, float]:
    with live.client() as c:
        text = c.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _stream_and_hang_up(
    live: LiveServer,
    path: str,
    body: dict[str, object],
    chunks: int,
    while_connected: Callable[[], None] = lambda: None,
) -> list[str]:
    lines = []
    with httpx.Client(base_url=live.url, timeout=10) as c, c.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:"):
                lines.append(line)
            if len(lines) == chunks:
                while_connected()
                break  # leaving the block closes the connection mid-stream
    return lines


def test_a_client_that_disconnects_mid_stream_aborts_its_sequence_and_frees_its_blocks(
    slow_server: LiveServer,
) -> None:
    def still_running() -> None:
        load = slow_server.load()
        assert load["num_running"] == 1
        assert (
            isinstance(load["kv_cache_usage"], float) and load["kv_cache_usage"] > 0
        )  # it grows a block per 16 tokens

    body = {"model": "tiny", "prompt": "x" * 40, "max_tokens": 200, "stream": True}
    assert (
        len(
            _stream_and_hang_up(slow_server, "/v1/completions", body, chunks=3, while_connected=still_running)
        )
        == 3
    )
    slow_server.wait_until(lambda: slow_server.load()["num_running"] == 0, "the abort to free the sequence")
    load = slow_server.load()
    assert (load["num_waiting"], load["kv_cache_usage"]) == (0, 0.0)
    metrics = _samples(slow_server)
    assert metrics["kvfleet_engine_requests_finished_total{finish_reason=abort}"] == 1.0
    assert metrics["kvfleet_engine_kv_cache_usage_ratio"] == 0.0


def test_a_chat_stream_abandoned_after_its_first_chunk_is_aborted_too(slow_server: LiveServer) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 200,
        "stream": True,
    }
    _stream_and_hang_up(slow_server, "/v1/chat/completions", body, chunks=2)
    slow_server.wait_until(
        lambda: (
            _samples(slow_server).get("kvfleet_engine_requests_finished_total{finish_reason=abort}") == 1.0
        ),
        "the abort to be counted",
    )
    assert slow_server.load()["kv_cache_usage"] == 0.0


def test_every_metric_name_of_the_design_is_exported_with_vllms_names(fast_server: LiveServer) -> None:
    with fast_server.client() as c:
        c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        text = c.get("/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    base = "kvfleet_engine_"
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "queue_time_seconds",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_ratio",
        "prompt_tokens",
        "generation_tokens",
        "preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
    ):
        assert base + name in names, name
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= names


def test_the_latency_buckets_resolve_5ms_to_60s_for_ttft_and_1ms_to_2s_for_tpot(
    fast_server: LiveServer,
) -> None:
    m = _samples(fast_server)
    ttft = {k for k in m if k.startswith("kvfleet_engine_time_to_first_token_seconds_bucket")}
    tpot = {k for k in m if k.startswith("kvfleet_engine_time_per_output_token_seconds_bucket")}
    assert {
        "kvfleet_engine_time_to_first_token_seconds_bucket{le=0.005}",
        "kvfleet_engine_time_to_first_token_seconds_bucket{le=60.0}",
    } <= ttft
    assert {
        "kvfleet_engine_time_per_output_token_seconds_bucket{le=0.001}",
        "kvfleet_engine_time_per_output_token_seconds_bucket{le=2.0}",
    } <= tpot
    assert "kvfleet_engine_inter_token_latency_seconds_bucket{le=0.001}" in m


def test_one_request_moves_each_counter_by_its_exact_token_counts(fast_server: LiveServer) -> None:
    before = _samples(fast_server)
    with fast_server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "abcdefg", "max_tokens": 4})
        assert r.status_code == 200
    after = _samples(fast_server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvfleet_engine_prompt_tokens_total") == 8.0  # BOS + 7 bytes
    assert delta("kvfleet_engine_generation_tokens_total") == 4.0
    assert delta("kvfleet_engine_time_to_first_token_seconds_count") == 1.0
    assert delta("kvfleet_engine_time_per_output_token_seconds_count") == 1.0
    assert delta("kvfleet_engine_inter_token_latency_seconds_count") == 3.0
    assert delta("kvfleet_engine_e2e_request_latency_seconds_count") == 1.0
    assert delta("kvfleet_engine_requests_finished_total{finish_reason=length}") == 1.0
    assert delta("kvfleet_engine_prefix_cache_queries_total") == 8.0


def test_the_load_document_is_the_routers_engine_load(fast_server: LiveServer) -> None:
    from kvfleet.protocol import EngineLoad

    load = EngineLoad.model_validate(fast_server.load())
    assert (load.model, load.max_num_seqs, load.block_size, load.num_kv_blocks, load.draining) == (
        "tiny",
        8,
        16,
        64,
        False,
    )


def test_a_non_streaming_client_that_gives_up_aborts_its_sequence(slow_server: LiveServer) -> None:
    body = {"model": "tiny", "prompt": "wait for me", "max_tokens": 200}  # 4 s of 20 ms steps
    with httpx.Client(base_url=slow_server.url, timeout=0.5) as c:
        try:
            c.post("/v1/completions", json=body)
            raise AssertionError("the completion should have outlasted the client's timeout")
        except httpx.ReadTimeout:
            pass
    slow_server.wait_until(
        lambda: (
            _samples(slow_server).get("kvfleet_engine_requests_finished_total{finish_reason=abort}") == 1.0
        ),
        "the abandoned request to be aborted",
    )
    assert (slow_server.load()["num_running"], slow_server.load()["kv_cache_usage"]) == (0, 0.0)
