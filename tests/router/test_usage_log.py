"""The usage log (``--usage-log``): one JSON line per finished request, that adds up to the router's metrics."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.router import cli as router_cli
from kvfleet.router.usage import UsageLog, UsageLogError, check_writable
from kvfleet.testing.fault_load import BackgroundLoad, LoadSpec, Tenant, run_load
from kvfleet.testing.processes import SimFlags, routers, sim_engines

SIM = SimFlags(max_num_seqs=8, num_kv_blocks=256, base_ms=5.0, max_model_len=2048)
TENANTS = [Tenant("alice", "sk-alice-0123456789"), Tenant("bob", "sk-bob-0123456789"),
           Tenant("carol", "sk-carol-0123456789")]  # fmt: skip


def _tenants_yaml(path: Path) -> Path:
    """Three tenants; carol may run one request at a time, so some of hers get a 429."""
    lines = ["tenants:"]
    for t in TENANTS:
        lines += [f"  - tenant: {t.name}", f"    apiKey: {t.key}"]
        if t.name == "carol":
            lines += ["    limits:", "      maxConcurrentRequests: 1"]
    path.write_text("\n".join(lines) + "\n")
    return path


def _records(path: Path) -> list[dict[str, Any]]:
    files = sorted(path.parent.glob(path.name + "*"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def _counters(metrics_text: str) -> dict[tuple[str, str, str], float]:
    """(metric, tenant, code-or-'') → value, for the router's request and token counters."""
    out: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in ("kvfleet_router_requests_total", "kvfleet_router_prompt_tokens_total",
                          "kvfleet_router_generation_tokens_total"):  # fmt: skip
                out[(s.name, s.labels["tenant"], s.labels.get("code", ""))] += s.value
    return out


def _sums(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
    out: dict[tuple[str, str, str], float] = collections.defaultdict(float)
    for r in records:
        out[("kvfleet_router_requests_total", r["tenant"], str(r["status"]))] += 1
        if r["status"] == 200:  # the router's token counters count answered requests
            out[("kvfleet_router_prompt_tokens_total", r["tenant"], "")] += r["prompt_tokens"]
            out[("kvfleet_router_generation_tokens_total", r["tenant"], "")] += r["output_tokens"]
    return out


def test_records_rotate_by_size_and_no_record_is_split_or_lost(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    log = UsageLog(str(path), max_bytes=2000, backups=100)
    for i in range(300):
        log.write({"tenant": "alice", "n": i, "pad": "x" * (i % 50)})
    log.close()
    files = list(tmp_path.glob("usage.jsonl*"))
    assert len(files) > 5
    assert all(f.stat().st_size <= 2000 for f in files)
    assert sorted(r["n"] for r in _records(path)) == list(range(300))


def test_rotation_keeps_only_the_backups_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    log = UsageLog(str(path), max_bytes=500, backups=2)
    for i in range(200):
        log.write({"n": i})
    log.close()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["usage.jsonl", "usage.jsonl.1", "usage.jsonl.2"]
    numbers = sorted(r["n"] for r in _records(path))
    assert numbers == list(range(numbers[0], 200))  # the newest records, none missing among them


def test_an_unwritable_usage_log_is_a_clear_error_naming_the_path(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "no" / "such" / "dir" / "usage.jsonl"
    with pytest.raises(UsageLogError, match=str(bad)):
        check_writable(str(bad))
    parser = __import__("argparse").ArgumentParser()
    router_cli.add_arguments(parser)
    args = parser.parse_args(["--engines", "http://127.0.0.1:1", "--usage-log", str(bad)])
    assert router_cli.run(args) == 2
    err = capsys.readouterr().err
    assert "--usage-log" in err and str(bad) in err and "No such file" in err


@pytest.mark.timeout(180)
def test_three_tenants_usage_records_add_up_to_the_router_metrics_exactly(tmp_path: Path) -> None:
    usage = tmp_path / "usage.jsonl"
    tenants = _tenants_yaml(tmp_path / "tenants.yaml")
    extra = ["--usage-log", str(usage), "--usage-log-max-bytes", "20000"]
    with sim_engines(2, SIM) as engines, routers(1, [e.url for e in engines], tenants, extra) as (router,):
        tally = asyncio.run(
            run_load(LoadSpec([router.url], TENANTS, requests=90, concurrency=9, max_tokens=8))
        )
        metrics = httpx.get(router.url + "/metrics").text
        router.process.send_signal(signal.SIGTERM)
        router.process.wait(30)
    records = _records(usage)
    assert len(list(tmp_path.glob("usage.jsonl.*"))) >= 1  # it rotated under the load
    assert len(records) == len(tally.outcomes) == 90
    statuses = collections.Counter(r["status"] for r in records)
    assert statuses[200] == tally.count("completed") and statuses[429] > 0
    counters = _counters(metrics)
    assert {k: v for k, v in counters.items() if k[1] != "unknown"} == _sums(records)
    ok = next(r for r in records if r["status"] == 200)
    assert (
        ok["model"] == "tiny" and ok["engine"] and ok["finish_reason"] == "length" and ok["trace_id"] is None
    )
    assert ok["output_tokens"] == 8 and ok["ttft_s"] <= ok["duration_s"]
    assert not any(t.key in usage.read_text() for t in TENANTS)  # never a key, never a prompt
    assert "lorem" not in usage.read_text()


@pytest.mark.timeout(180)
def test_a_sigterm_mid_load_loses_no_finished_requests_record(tmp_path: Path) -> None:
    usage = tmp_path / "usage.jsonl"
    tenants = _tenants_yaml(tmp_path / "tenants.yaml")
    slow = SimFlags(max_num_seqs=8, num_kv_blocks=256, base_ms=20.0, max_model_len=2048)
    with sim_engines(2, slow) as engines, routers(1, [e.url for e in engines], tenants,
                                                  ["--usage-log", str(usage)]) as (router,):  # fmt: skip
        load = BackgroundLoad(LoadSpec([router.url], TENANTS, requests=400, concurrency=9, max_tokens=24))
        load.wait_for(45, limit_s=90)  # ended, not all completed (a throttled tenant's 429s): >= 30 completed
        router.process.send_signal(signal.SIGTERM)
        router.process.wait(60)
        tally = load.result(stop=True)
    records = _records(usage)
    seen = collections.Counter(o.tenant for o in tally.outcomes if o.kind == "completed")
    logged = collections.Counter(r["tenant"] for r in records if r["status"] == 200)
    print(f"completed by the clients: {dict(seen)}; records of 200s: {dict(logged)}", file=sys.stderr)
    assert sum(seen.values()) >= 30
    assert logged == seen
