"""A fleet that heals: an engine core SIGKILLed mid-stream, and an engine whose /health hangs, under `kvfleet up`.

Real processes throughout (`kvfleet up` on the tiny model: router, two engines, their
core processes). Each test prints how long the fleet took to serve from two engines again.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvfleet.router.local import LOCAL_API_KEY
from kvfleet.testing.faults import LocalUp, argv_of, children
from kvfleet.testing.processes import free_port

HEADERS = {"Authorization": f"Bearer {LOCAL_API_KEY}"}


class Fleet(LocalUp):
    def serving(self, limit_s: float = 120.0, avoid: str = "") -> set[str]:
        """Until two engines (neither ``avoid``) have answered a completion; their host:ports."""
        seen: set[str] = set()
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "kvfleet up exited"
            try:
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
                r = httpx.post(f"{self.url}/v1/completions", json=body, headers=HEADERS, timeout=10)
                if r.status_code == 200 and r.headers["x-kvfleet-engine"] != avoid:
                    seen.add(r.headers["x-kvfleet-engine"])
                    if len(seen) == 2:
                        return seen
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the fleet never served from two engines again (saw {sorted(seen)})")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    port, log = free_port(), tmp_path / "up.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvfleet.cli", "up", "--replicas", "2", "--model", "tiny",
             "--port", str(port), "--engine-arg=--num-kv-blocks=512"],
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=sink, stderr=sink, start_new_session=True,
        )  # fmt: skip
    f = Fleet(f"http://127.0.0.1:{port}", process, log)
    try:
        f.serving()
        yield f
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


def _stream(url: str) -> tuple[str, str]:
    """One long stream: (the engine that served it, the whole SSE text)."""
    body = {"model": "tiny", "prompt": "count", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=HEADERS, timeout=120) as r:
        return r.headers.get("x-kvfleet-engine", ""), r.read().decode()


@pytest.mark.slow
def test_a_core_killed_mid_stream_fails_its_streams_cleanly_and_the_fleet_replaces_the_engine(
    fleet: Fleet,
) -> None:
    victim_url, victim_pid = sorted(fleet.engines().items())[0]
    cores = [p for p in children(victim_pid) if "spawn_main" in " ".join(argv_of(p))]
    assert len(cores) == 1
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(_stream, fleet.url) for _ in range(6)]
        time.sleep(1.5)  # every stream has started generating
        killed_at = time.monotonic()
        os.kill(cores[0], signal.SIGKILL)
        during = [pool.submit(lambda: httpx.post(f"{fleet.url}/v1/completions", headers=HEADERS, timeout=60,
                  json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code) for _ in range(10)]  # fmt: skip
        results = [s.result(timeout=240) for s in streams]  # 1500 tokens each on a loaded 2-core box
        assert [d.result(timeout=120) for d in during] == [200] * 10, "nothing new is lost to the dead engine"
    on_victim = [text for engine, text in results if engine == victim_url]
    elsewhere = [text for engine, text in results if engine != victim_url]
    assert on_victim and elsewhere, "the router spread the streams over both engines"
    for text in on_victim:
        assert '"code": "engine_dead"' in text or '"code":"engine_dead"' in text, text[-400:]
        assert text.rstrip().endswith("data: [DONE]")
    for text in elsewhere:
        assert '"error"' not in text and text.rstrip().endswith("data: [DONE]")
    healed = fleet.serving(avoid=victim_url)
    print(f"\ncore SIGKILLed -> fleet serving from two engines again in {time.monotonic() - killed_at:.1f} s")
    assert victim_url not in healed
    log = fleet.log.read_text()
    assert "ERROR" in log and "the engine core process died" in log and "killed by SIGKILL" in log
    # the engine process exited non-zero once its core was dead, and was replaced for it
    assert f"WARNING kvfleet.up: engine http://{victim_url}: its process ended (exit code 3)" in log


@pytest.mark.slow
def test_an_engine_whose_health_stops_answering_is_replaced(fleet: Fleet) -> None:
    victim_url, victim_pid = sorted(fleet.engines().items())[0]
    time.sleep(
        2.5
    )  # kvfleet up's watcher (1 s period) has seen it healthy: only then is a failing /health held against it
    stopped_at = time.monotonic()
    os.kill(victim_pid, signal.SIGSTOP)  # alive, but answers nothing
    try:
        healed = fleet.serving(avoid=victim_url)
    finally:
        if Path(f"/proc/{victim_pid}").exists():
            os.kill(victim_pid, signal.SIGCONT)
    print(
        f"\nengine SIGSTOPped -> fleet serving from two engines again in {time.monotonic() - stopped_at:.1f} s"
    )
    assert victim_url not in healed
    log = fleet.log.read_text()
    assert f"WARNING kvfleet.up: engine http://{victim_url}: /health failed for" in log
