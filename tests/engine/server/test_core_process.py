"""The engine core's own process: it never outlives the server, its death is a 503 (not a hang), it stays torch-free under --simulate, and only it loads torch for a real model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from kvfleet.testing.processes import free_port

if TYPE_CHECKING:
    from conftest import LiveServer, Procs

COMPLETION = {"model": "tiny", "prompt": "x", "max_tokens": 2}


def _wait_ready(url: str, proc: subprocess.Popen[bytes], limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the engine did not become ready"
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


def test_a_killed_server_takes_its_torch_free_simulated_core_with_it(procs: Procs) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "kvfleet.cli", "engine", "--simulate", "--host", "127.0.0.1", "--port", str(port),
           "--num-kv-blocks", "16", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc)
        children = procs.children_of(proc.pid)  # the core, and multiprocessing's resource tracker
        cores = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(cores) == 1
        assert "libtorch" not in Path(f"/proc/{cores[0]}/maps").read_text()
        proc.send_signal(signal.SIGKILL)  # no drain, no shutdown message: only the pipe's EOF tells the core
        assert proc.wait(20) == -signal.SIGKILL
        procs.wait_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_only_the_core_of_a_tiny_model_server_loads_torch_never_its_api_process(procs: Procs) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "kvfleet.cli", "engine", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--num-kv-blocks", "16", "--log-level", "warning"]  # fmt: skip
    proc, children = subprocess.Popen(cmd), []
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc, limit_s=60.0)
        children = procs.children_of(proc.pid)
        cores = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        # The API process tokenises with the checkpoint's tokenizer.json, not through the model's config.
        assert ("libtorch" in Path(f"/proc/{proc.pid}/maps").read_text(), len(cores)) == (False, 1)
        assert "libtorch" in Path(f"/proc/{cores[0]}/maps").read_text()
    finally:
        proc.kill()
        proc.wait(10)
        procs.wait_gone(children)


def test_a_core_process_that_dies_turns_health_and_new_requests_into_503s(
    own_fast_server: LiveServer,
) -> None:
    with own_fast_server.client() as c:
        assert c.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"] == "ab"
        pid = own_fast_server.state.engine.core.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        own_fast_server.wait_until(
            lambda: c.get("/health").status_code == 503, "health to report the dead core"
        )
        r = c.post("/v1/completions", json=COMPLETION)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_dead")
        assert c.get("/ready").status_code == 503


def test_the_thread_core_serves_the_same_completion(thread_server: LiveServer) -> None:
    with thread_server.client() as c:
        r = c.post("/v1/completions", json={**COMPLETION, "max_tokens": 3, "stop": ["c"]}).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("ab", "stop")
    assert thread_server.state.engine.core.alive is True
