"""Start and stop a ``kvfleet engine`` process for the benchmarks in this folder (not a test helper)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def engine_process(*flags: str, ready_timeout_s: float = 300.0) -> Iterator[str]:
    """``kvfleet engine FLAGS`` on 127.0.0.1; yields its base URL once /ready answers 200; SIGTERM at the end."""
    with engine_process_handle(*flags, ready_timeout_s=ready_timeout_s) as (url, _):
        yield url


@contextmanager
def engine_process_handle(
    *flags: str, ready_timeout_s: float = 300.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """As :func:`engine_process`, yielding the process too (to read its CPU time)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvfleet.cli",
        "engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *flags,
    ]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvfleet engine exited with {proc.returncode}")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvfleet engine did not become ready")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
