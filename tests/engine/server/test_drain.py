"""SIGTERM drains a real ``kvfleet engine --simulate`` process: not ready, new requests 503, streams finish, exit 0.

The grace period (``--drain-timeout 4``) is four times the short stream's length, and the
long stream is seven times the grace period, so the outcome does not hang on the machine's speed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from kvfleet.testing.processes import free_port

if TYPE_CHECKING:
    from conftest import Procs

# 20 ms per step (the simulator sleeps it): 50 tokens take about 1 s, 1500 about 30 s.
FLAGS = ("--simulate", "--host", "127.0.0.1", "--num-kv-blocks", "64", "--max-model-len", "2048",
         "--sim-base-ms", "20", "--sim-per-token-ms", "0", "--sim-per-context-token-us", "0", "--log-level", "warning")  # fmt: skip


class Engine:
    def __init__(self, drain_timeout: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvfleet.cli", "engine", *FLAGS, "--port", str(self.port)]
        self.proc = subprocess.Popen([*cmd, "--drain-timeout", str(drain_timeout)])
        deadline = time.monotonic() + 30
        while not self._ready():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                raise RuntimeError("kvfleet engine did not become ready")
            time.sleep(0.05)

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stream_in_background(self, max_tokens: int, running: int) -> tuple[threading.Thread, list[str]]:
        lines: list[str] = []
        body = {"model": "tiny", "prompt": "drain me", "max_tokens": max_tokens, "stream": True}

        def read() -> None:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as resp:
                lines.extend(line for line in resp.iter_lines() if line.startswith("data:"))

        thread = threading.Thread(target=read)
        thread.start()
        deadline = time.monotonic() + 10
        while httpx.get(self.url + "/load", timeout=5).json()["num_running"] != running:
            assert time.monotonic() < deadline, "the stream never started running"
            time.sleep(0.02)
        return thread, lines


@pytest.fixture
def engine_proc() -> Iterator[Engine]:
    engine = Engine(drain_timeout=4)
    yield engine
    if engine.proc.poll() is None:
        engine.proc.kill()
        engine.proc.wait(10)


def _text_and_reason(lines: list[str]) -> tuple[str, str | None]:
    chunks = [json.loads(line[5:]) for line in lines if line != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


def test_sigterm_drains_short_streams_aborts_those_past_the_grace_period_and_exits_0(
    engine_proc: Engine, procs: Procs
) -> None:
    children = procs.children_of(engine_proc.proc.pid)  # the engine core (and multiprocessing's tracker)
    assert children
    short, short_lines = engine_proc.stream_in_background(max_tokens=50, running=1)  # about 1 s
    long, long_lines = engine_proc.stream_in_background(max_tokens=1500, running=2)  # about 30 s
    engine_proc.proc.send_signal(signal.SIGTERM)
    ready = httpx.get(engine_proc.url + "/ready", timeout=5)
    assert (ready.status_code, ready.json()) == (503, {"ready": False, "draining": True})
    refused = httpx.post(
        engine_proc.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5
    )
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    assert httpx.get(engine_proc.url + "/load", timeout=5).json()["draining"] is True
    short.join(30)
    long.join(30)
    assert engine_proc.proc.wait(30) == 0
    procs.wait_gone(children)  # the core was shut down with the server, not orphaned
    assert short_lines[-1] == long_lines[-1] == "data: [DONE]"
    assert _text_and_reason(short_lines) == (
        "abcdefghijklmnopqrstuvwxyz" + "abcdefghijklmnopqrstuvwx",
        "length",
    )
    text, reason = _text_and_reason(long_lines)
    assert reason == "abort"
    assert 0 < len(text) < 1500
