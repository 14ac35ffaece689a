"""The engine core's own process: it never outlives the server, its death is a 503 (not a hang), and it stays torch-free under --simulate."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import LiveServer


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is ``pid``, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited while we looked
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def wait_for(predicate: object, what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("sig", "exit_code"),
    [
        (signal.SIGTERM, 0),
        (signal.SIGKILL, -signal.SIGKILL),
    ],  # drained and shut down; killed: only the pipe's EOF tells
)
def test_a_stopped_or_killed_server_takes_its_torch_free_simulated_core_with_it(
    sig: int, exit_code: int
) -> None:
    with httpx.Client() as probe:
        port = _free_port()
        cmd = [sys.executable, "-m", "kvfleet.cli", "engine", "--simulate", "--host", "127.0.0.1", "--port", str(port),
               "--num-kv-blocks", "16", "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(cmd)
        try:
            wait_for(lambda: _ready(probe, port), "the engine to be ready")
            children = children_of(proc.pid)  # the core, and multiprocessing's resource tracker
            cores = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
            assert len(cores) == 1
            assert "libtorch" not in Path(f"/proc/{cores[0]}/maps").read_text()
            proc.send_signal(
                signal.SIGKILL
            )  # no drain, no shutdown message: only the pipe's EOF tells the core
            proc.wait(10)
            wait_for(lambda: all(is_gone(pid) for pid in children), "the orphaned core to exit")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_a_core_process_that_dies_turns_health_and_new_requests_into_503s(
    own_fast_server: LiveServer,
) -> None:
    live = own_fast_server
    with live.client() as c:
        assert (
            c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).json()[
                "choices"
            ][0]["text"]
            == "ab"
        )
        pid = live.state.engine.core.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        live.wait_until(lambda: c.get("/health").status_code == 503, "health to report the dead core")
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_dead")
        assert c.get("/ready").status_code == 503


def test_the_thread_core_serves_the_same_completion(thread_server: LiveServer) -> None:
    live = thread_server
    with live.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3, "stop": ["c"]})
        assert (r.status_code, r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]) == (
            200,
            "ab",
            "stop",
        )
    assert live.state.engine.core.alive is True


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(client: httpx.Client, port: int) -> bool:
    try:
        return client.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
