"""Real fleet processes for the tests and the benches: simulated engines and router replicas.

``kvfleet engine --simulate`` (the real scheduler and KV accounting on a timing model)
stands in for GPU engines, ``kvfleet router`` in front of them; :func:`engine_process`
starts any ``kvfleet engine``. The tests and ``bench/*.py`` start them from here, so there is
one launcher (ports from :func:`kvfleet.oslib.free_port`, which ``kvfleet up`` uses too). Every process binds 127.0.0.1, waits are bounded, and everything started is
stopped when its context ends. This module imports no torch: the engines run in their
own processes.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from kvfleet.oslib import free_port


def kvfleet_argv(*args: str, cpus: str | None = None) -> list[str]:
    """``python -m kvfleet.cli ARGS``, pinned to ``cpus`` with taskset where it exists."""
    pin = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
    return [*pin, sys.executable, "-m", "kvfleet.cli", *args]


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
    """Until ``url`` answers below 500; raises if ``proc`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up in {timeout_s}s")


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM all, then wait; SIGKILL whichever is still there after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def engine_process(
    *flags: str, ready_timeout_s: float = 300.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``kvfleet engine FLAGS`` on a free port of 127.0.0.1; yields its base URL and process once
    ``/ready`` answers; stopped (SIGTERM, then SIGKILL after 10 s) at the end."""
    port = free_port()
    argv = kvfleet_argv(
        "engine", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags
    )
    proc = subprocess.Popen(argv)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", proc, timeout_s=ready_timeout_s)
        yield url, proc
    finally:
        stop([proc])


@dataclass(frozen=True)
class SimFlags:
    """The simulated engine's shape and timing model (``kvfleet engine --simulate`` flags)."""

    max_num_seqs: int = 16
    num_kv_blocks: int = 512
    base_ms: float = 10.0
    per_token_ms: float = 0.05
    per_context_token_us: float = 0.0
    max_model_len: int = 4096

    def argv(self) -> list[str]:
        return [
            "--max-num-seqs", str(self.max_num_seqs), "--num-kv-blocks", str(self.num_kv_blocks),
            "--sim-base-ms", str(self.base_ms), "--sim-per-token-ms", str(self.per_token_ms),
            "--sim-per-context-token-us", str(self.per_context_token_us), "--max-model-len", str(self.max_model_len),
        ]  # fmt: skip


def lora_flags(adapters: Sequence[str], max_loras: int, load_ms: float = 50.0) -> list[str]:
    """A simulated engine's adapter flags: each adapter at ``/adapters/<name>``, ``max_loras`` slots."""
    modules = [f"{a}=/adapters/{a}" for a in adapters]
    return ["--lora-modules", *modules, "--max-loras", str(max_loras), "--sim-lora-load-ms", f"{load_ms:g}"]


class SimEngine(NamedTuple):
    url: str
    process: subprocess.Popen[bytes]


def spawn_engine(port: int, flags: SimFlags, extra: Sequence[str] = (), cpus: str | None = None) -> SimEngine:
    """Start one simulated engine of the tiny model on ``port`` (not waited for)."""
    argv = kvfleet_argv("engine", "--simulate", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port),
                        "--log-level", "warning", *flags.argv(), *extra, cpus=cpus)  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)  # warnings and errors stay visible
    return SimEngine(f"http://127.0.0.1:{port}", proc)


@contextlib.contextmanager
def sim_engines(
    n: int, flags: SimFlags, extra: Sequence[str] = (), cpus: str | None = None
) -> Iterator[list[SimEngine]]:
    """``n`` simulated engines, each answering ``/health`` before this yields."""
    started: list[SimEngine] = []
    try:
        ports = [free_port() for _ in range(n)]
        started = [spawn_engine(port, flags, extra, cpus) for port in ports]
        for engine in started:
            wait_http(engine.url + "/health", engine.process)
        yield started
    finally:
        stop([e.process for e in started])


def tenants_file(path: Path, tenants: Sequence[tuple[str, str]]) -> Path:
    """A ``--tenants`` YAML file of (tenant, apiKey) pairs without limits."""
    lines = ["tenants:"]
    for name, key in tenants:
        lines += [f"  - tenant: {name}", f"    apiKey: {key}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def _sees_every_engine(url: str, n_engines: int) -> bool:
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        ready = httpx.get(url + "/ready", timeout=2).json()["ready_engines"]
        return bool(sum(ready.values()) >= n_engines)
    return False


class RouterProcess(NamedTuple):
    url: str
    process: subprocess.Popen[bytes]


def spawn_router(
    port: int,
    engine_urls: Sequence[str],
    tenants: Path,
    extra: Sequence[str] = (),
    cpus: str | None = None,
    log: Path | None = None,
) -> RouterProcess:
    """Start one ``kvfleet router`` on ``port`` in front of ``engine_urls`` (not waited for).

    With ``log``, its whole output (stdout and stderr) is appended to that file, else stdout is
    dropped and stderr stays visible."""
    argv = kvfleet_argv("router", "--engines", ",".join(engine_urls), "--port", str(port),
                        "--tenants", str(tenants), *extra, cpus=cpus)  # fmt: skip
    out = log.open("ab") if log is not None else None
    with out or contextlib.nullcontext():
        proc = subprocess.Popen(argv, stdout=out or subprocess.DEVNULL, stderr=out)
    return RouterProcess(f"http://127.0.0.1:{port}", proc)


@contextlib.contextmanager
def routers(
    n: int,
    engine_urls: Sequence[str],
    tenants: Path,
    extra: Sequence[str] = (),
    cpus: str | None = None,
    timeout_s: float = 30.0,
    log: Path | None = None,
) -> Iterator[list[RouterProcess]]:
    """``n`` ``kvfleet router`` processes, started together; yields once each has read every engine's load.

    With ``log``, each one's whole output (stdout and stderr) goes to that file (appended), else
    stdout is dropped and stderr stays visible."""
    ports = [free_port() for _ in range(n)]
    started: list[RouterProcess] = []
    try:
        for port in ports:
            started.append(spawn_router(port, engine_urls, tenants, extra, cpus, log))
        for url, proc in started:
            wait_http(url + "/ready", proc)
            deadline = time.monotonic() + timeout_s
            while not _sees_every_engine(url, len(engine_urls)) and time.monotonic() < deadline:
                time.sleep(0.05)
        yield started
    finally:
        stop([r.process for r in started])


@contextlib.contextmanager
def router_processes(n: int, *args: Any, **kwargs: Any) -> Iterator[list[str]]:
    """As :func:`routers` (same arguments), yielding only the base URLs."""
    with routers(n, *args, **kwargs) as started:
        yield [r.url for r in started]


@contextlib.contextmanager
def redis_process(port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ``redis-server`` on 127.0.0.1 (no persistence); yields its URL and process once it answers PING."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is missing: `make system-deps` installs it"
    port = port or free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10.0
        while not _answers_ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        stop([proc])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
