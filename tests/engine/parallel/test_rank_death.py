"""A tensor-parallel rank that dies takes the served engine down cleanly: 503 engine_dead, exit 3, no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvfleet.testing.processes import free_port

WORKER = b"kvfleet.engine.parallel.worker"


def _workers_of(server_pid: int) -> list[int]:
    """The tp workers under the server (children of its core process)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if WORKER not in (entry / "cmdline").read_bytes():
                continue
            core = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            core_parent = int(Path(f"/proc/{core}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if core_parent == server_pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _serve_tp2() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvfleet.cli", "engine", "--model", "tiny", "-tp", "2", "--host", "127.0.0.1",
           "--port", str(port), "--num-kv-blocks", "256", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the tp=2 engine did not become ready")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def test_a_killed_rank1_worker_fails_requests_with_503_and_exits_3() -> None:
    proc, url = _serve_tp2()
    try:
        (worker,) = _workers_of(proc.pid)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2000, "ignore_eos": True}
        got: list[httpx.Response] = []
        in_flight = threading.Thread(
            target=lambda: got.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
        )
        in_flight.start()
        time.sleep(1.0)  # generating: a long completion is mid-way
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(20) == 3, "the server exits 3 (engine dead) once a rank is gone"
        exited_in = time.monotonic() - killed_at
        in_flight.join(10)
        assert (got[0].status_code, got[0].json()["error"]["code"]) == (503, "engine_dead")
        assert exited_in < 15, f"took {exited_in:.1f} s"
        time.sleep(1.0)
        assert not _alive(worker) and _workers_of(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_killed_core_takes_its_worker_with_it() -> None:
    """Rank 0 (the core process) dies: its worker sees its control link close and exits, no orphan."""
    proc, _ = _serve_tp2()
    try:
        (worker,) = _workers_of(proc.pid)
        core = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(core, signal.SIGKILL)
        assert proc.wait(20) == 3
        deadline = time.monotonic() + 10
        while _alive(worker):
            assert time.monotonic() < deadline, "the worker outlived rank 0"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
