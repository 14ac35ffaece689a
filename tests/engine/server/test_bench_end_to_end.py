"""``kvfleet bench`` end to end against a simulated engine: every request streamed and counted exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING

from kvfleet.bench import LoadSpec, parse_distribution, run_load

if TYPE_CHECKING:
    from conftest import LiveServer


async def test_a_closed_loop_run_counts_every_prompt_and_output_token(fast_server: LiveServer) -> None:
    spec = LoadSpec(
        url=fast_server.url + "/v1",
        num_requests=12,
        concurrency=4,
        input_len=parse_distribution("fixed:20"),
        output_len=parse_distribution("uniform:3:6"),
        shared_prefix=0.5,
    )
    result = await run_load(spec)
    s = result.summary(slo_ttft_s=60.0, slo_tpot_s=60.0)
    assert (result.model, s.num_ok, s.num_failed) == ("tiny", 12, 0)
    assert s.total_prompt_tokens == 12 * 20  # token-id prompts: exactly the drawn length, no BOS added
    assert s.total_output_tokens == sum(r.output_tokens for r in result.records)
    assert all(3 <= r.output_tokens <= 6 for r in result.records)
    # One SSE chunk per step's token, or fewer when the stream lagged and pending tokens merged.
    assert all(len(r.itls) <= r.output_tokens - 1 for r in result.records)
    assert (s.goodput, s.slo_attainment) == (s.request_throughput, 1.0)


async def test_an_open_loop_chat_run_streams_every_request(fast_server: LiveServer) -> None:
    spec = LoadSpec(
        url=fast_server.url,
        endpoint="chat",
        num_requests=6,
        rate=200.0,
        input_len=parse_distribution("fixed:5"),
        output_len=parse_distribution("fixed:4"),
    )
    result = await run_load(spec)
    assert [(r.ok, r.output_tokens) for r in result.records] == [(True, 4)] * 6


def test_the_command_prints_json_with_the_latency_percentiles(fast_server: LiveServer) -> None:
    cmd = [sys.executable, "-m", "kvfleet.cli", "bench", "--url", fast_server.url, "--num-requests", "5",
           "--concurrency", "2", "--input-len", "fixed:8", "--output-len", "fixed:3", "--slo-ttft-ms", "60000", "--json"]  # fmt: skip
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout)
    assert (out["model"], out["num_ok"], out["total_output_tokens"], out["total_prompt_tokens"]) == (
        "tiny",
        5,
        15,
        40,
    )
    assert set(out["ttft"]) == {"mean", "p50", "p90", "p99"}
    assert out["slo_attainment"] == 1.0


def test_the_command_names_a_bad_distribution() -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvfleet.cli",
        "bench",
        "--url",
        "http://127.0.0.1:9",
        "--input-len",
        "poisson:3",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "'poisson:3': expected fixed:N" in done.stderr
