"""Real processes for the router's integration tests: ``kvfleet engine --simulate`` and ``kvfleet router``."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from .conftest import free_port

SIM = ["--max-num-seqs", "8", "--num-kv-blocks", "256", "--sim-base-ms", "5", "--sim-per-token-ms", "0.05",
       "--sim-per-context-token-us", "0", "--max-model-len", "2048"]  # fmt: skip


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args!r} exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} did not come up in {timeout_s}s")


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spawn_engine(port: int, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "kvfleet.cli", "engine", "--simulate", "--model", "tiny", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *SIM, *extra]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def sim_engines(n: int, extra: Sequence[str] = ()) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    ports = [free_port() for _ in range(n)]
    procs = [spawn_engine(p, extra) for p in ports]
    try:
        out = [(f"http://127.0.0.1:{p}", proc) for p, proc in zip(ports, procs, strict=True)]
        for url, proc in out:
            wait_http(url + "/health", proc)
        yield out
    finally:
        stop(procs)


@contextlib.contextmanager
def router_processes(
    n: int, engine_urls: Sequence[str], tenants: Path, extra: Sequence[str] = ()
) -> Iterator[list[str]]:
    """``n`` ``kvfleet router`` processes, started together; yields once each has read every engine's load."""
    ports = [free_port() for _ in range(n)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvfleet.cli",
                "router",
                "--engines",
                ",".join(engine_urls),
                "--port",
                str(port),
                "--tenants",
                str(tenants),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for port in ports
    ]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url, proc in zip(urls, procs, strict=True):
            wait_http(url + "/ready", proc)
            for _ in range(400):
                if sum(httpx.get(url + "/ready", timeout=2).json()["ready_engines"].values()) == len(
                    engine_urls
                ):
                    break
                time.sleep(0.05)
        yield urls
    finally:
        stop(procs)
