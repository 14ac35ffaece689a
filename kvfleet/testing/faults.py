"""The fault suite's fleets and probes: real processes to break, and what to read after.

Where it sits: :mod:`kvfleet.testing.fault_scenarios` breaks these fleets under the load of
:mod:`kvfleet.testing.fault_load`; ``e2e/test_faults.py`` asserts on what it finds and
``bench/router/faults.py`` prints it. Two fleets, both of simulated engines (the real scheduler,
KV accounting and HTTP server on a timing model: the faults are in the processes, not the
model):

- :func:`local_up`: ``kvfleet up --simulate`` (its router in-process, engines it supervises
  and restarts, SIGHUP for a rolling restart);
- :func:`static_fleet`: engines nobody supervises, and ``kvfleet router`` replicas over one
  real ``redis-server``, each of which can be restarted on its own port.

Every wait is bounded; everything started is stopped when its context ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.testing.fault_load import Tenant
from kvfleet.testing.processes import (
    RouterProcess,
    SimFlags,
    free_port,
    kvfleet_argv,
    redis_process,
    sim_engines,
    spawn_router,
    stop,
    wait_http,
)

TENANTS = (
    Tenant("acme", "sk-fault-acme-000001"),
    Tenant("globex", "sk-fault-globex-0001"),
    Tenant("initech", "sk-fault-initech-001"),
)
# Room for the load (two clients per tenant), so a refusal in the counts is the fault's, not a quota's.
LIMITS = {"maxConcurrentRequests": 16, "requestsPerMinute": 100_000, "tokensPerMinute": 10_000_000}
SIM = SimFlags(max_num_seqs=16, num_kv_blocks=1024, base_ms=10.0, per_token_ms=0.05, max_model_len=8192)
STALL_S = 2.0  # the fleets' --stream-stall-timeout
READ_TIMEOUT_S = 2.0  # the fleets' --engine-read-timeout
SEND_BUFFER_KIB = 16  # the fleets' --stream-send-buffer: an unread stream stalls within a few seconds


def write_tenants(path: Path, tenants: Sequence[Tenant] = TENANTS) -> Path:
    lines = ["tenants:"]
    for t in tenants:
        lines += [f"  - tenant: {t.name}", f"    apiKey: {t.key}", "    limits:"]
        lines += [f"      {k}: {v}" for k, v in LIMITS.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def until(predicate: Callable[[], bool], limit_s: float, what: str) -> float:
    """Seconds until ``predicate()`` holds, polled every 50 ms; raises after ``limit_s``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"{what}: not within {limit_s:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - start


def ready_engines(router_url: str) -> int:
    """How many engines the router has in rotation now (0 when it does not answer)."""
    try:
        return int(sum(httpx.get(f"{router_url}/ready", timeout=2).json()["ready_engines"].values()))
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def quota_held(router_url: str) -> tuple[float, float]:
    """(requests holding a quota charge, tokens reserved and not settled) on one router, from its /metrics."""
    text = httpx.get(f"{router_url}/metrics", timeout=5).text
    held = {"kvfleet_router_quota_in_flight": 0.0, "kvfleet_router_quota_reserved_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in held:
            held[family.name] = sum((s.value for s in family.samples), 0.0)
    return held["kvfleet_router_quota_in_flight"], held["kvfleet_router_quota_reserved_tokens"]


def settled(router_urls: Sequence[str], limit_s: float = 15.0) -> tuple[float, float]:
    """Wait (bounded) until no router holds quota; what they still hold then (0, 0 when all is settled)."""
    with contextlib.suppress(AssertionError):
        until(lambda: all(quota_held(u) == (0.0, 0.0) for u in router_urls), limit_s, "quota settled")
    held = [quota_held(u) for u in router_urls]
    return sum(h[0] for h in held), sum(h[1] for h in held)


def engine_running(engine_url: str) -> int:
    """Sequences running or waiting on an engine (its /load)."""
    load = httpx.get(f"{engine_url}/load", timeout=2).json()
    return int(load["num_running"]) + int(load["num_waiting"])


def children(pid: int) -> list[int]:
    """Live child processes of ``pid``, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def argv_of(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def engine_pids(parent: int) -> dict[str, int]:
    """The engine API processes ``parent`` started: their host:port → pid."""
    out: dict[str, int] = {}
    for pid in children(parent):
        argv = argv_of(pid)
        if "engine" in argv and "--port" in argv:
            out[f"127.0.0.1:{argv[argv.index('--port') + 1]}"] = pid
    return out


@dataclass
class LocalUp:
    """A running ``kvfleet up``: its router URL, its process, its log file (and its command, to restart it)."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path
    argv: list[str] = field(default_factory=list)
    replicas: int = 2

    def engines(self) -> dict[str, int]:
        return engine_pids(self.process.pid)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def start(self) -> None:
        """Start ``argv`` (appending to the log); returns once every engine serves through the router."""
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(
                self.argv,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=sink,
                stderr=sink,
                start_new_session=True,
            )
        proc = self.process
        until(
            lambda: proc.poll() is None and ready_engines(self.url) >= self.replicas,
            120,
            "kvfleet up serving",
        )

    def stop(self) -> None:
        """SIGTERM: the router finishes its streams, the engines drain; SIGKILL after 60 s."""
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


ENGINE_BOUNDS = [f"--stream-stall-timeout={STALL_S}", f"--stream-send-buffer={SEND_BUFFER_KIB}"]
ROUTER_BOUNDS = ["--engine-read-timeout", str(READ_TIMEOUT_S), "--stream-stall-timeout", str(STALL_S),
                 "--stream-send-buffer", str(SEND_BUFFER_KIB)]  # fmt: skip


def sim_engine_args(flags: SimFlags) -> list[str]:
    return [f"--engine-arg={a}" for a in [*flags.argv(), *ENGINE_BOUNDS]]


@contextlib.contextmanager
def local_up(workdir: Path, replicas: int = 2, flags: SimFlags = SIM) -> Iterator[LocalUp]:
    """``kvfleet up --simulate`` with the fault tenants, short stall and read bounds; yields once every engine serves."""
    port = free_port()
    argv = kvfleet_argv(
        "up", "--simulate", "--replicas", str(replicas), "--model", "tiny", "--port", str(port),
        "--tenants", str(write_tenants(workdir / "tenants.yaml")), *ROUTER_BOUNDS, *sim_engine_args(flags),
    )  # fmt: skip
    up = LocalUp(
        f"http://127.0.0.1:{port}", cast("subprocess.Popen[bytes]", None), workdir / "up.log", argv, replicas
    )
    try:
        up.start()
        yield up
    finally:
        if up.process is not None:
            up.stop()


@dataclass
class StaticFleet:
    """Simulated engines nobody restarts, ``kvfleet router`` replicas over one Redis."""

    engine_urls: list[str]
    engine_procs: list[subprocess.Popen[bytes]]
    routers: list[RouterProcess]
    redis_url: str
    redis_proc: subprocess.Popen[bytes]
    tenants: Path
    stack: contextlib.ExitStack
    extra: list[str] = field(default_factory=list)

    @property
    def router_urls(self) -> list[str]:
        return [r.url for r in self.routers]

    def restart_router(self, i: int, drain_limit_s: float = 60.0) -> float:
        """SIGTERM router ``i`` (it drains), start it again on its port; seconds until it serves again."""
        old = self.routers[i]
        old.process.terminate()
        old.process.wait(timeout=drain_limit_s)
        port = int(old.url.rsplit(":", 1)[1])
        start = time.monotonic()
        self.routers[i] = spawn_router(port, self.engine_urls, self.tenants, self.extra)
        wait_http(self.routers[i].url + "/health", self.routers[i].process)
        until(lambda: ready_engines(self.routers[i].url) >= len(self.engine_urls), 30, "router back")
        return time.monotonic() - start

    def stop_redis(self) -> None:
        self.redis_proc.terminate()
        self.redis_proc.wait(timeout=10)

    def start_redis(self) -> None:
        """Redis again on its port, empty (no persistence, as the chart's cache runs it)."""
        port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        _, self.redis_proc = self.stack.enter_context(redis_process(port))

    def redis_leases(self) -> dict[str, int]:
        """Concurrency slots and queue slots in Redis per tenant (the keys of router/redis_store.py)."""
        import redis

        client = redis.Redis.from_url(self.redis_url)
        try:
            return {
                t.name: int(client.zcard(f"kvfleet:quota:{{{t.name}}}:leases"))
                + int(client.zcard(f"kvfleet:quota:{{{t.name}}}:queued"))
                for t in TENANTS
            }
        finally:
            client.close()


@contextlib.contextmanager
def static_fleet(workdir: Path, n_engines: int = 2, n_routers: int = 2) -> Iterator[StaticFleet]:
    """``n_engines`` simulated engines, ``n_routers`` routers on one Redis; yields once each router sees every engine."""
    tenants = write_tenants(workdir / "tenants.yaml")
    with contextlib.ExitStack() as stack:
        redis_url, redis_proc = stack.enter_context(redis_process())
        engines = stack.enter_context(sim_engines(n_engines, SIM, ENGINE_BOUNDS))
        extra = ["--redis", redis_url, *ROUTER_BOUNDS]
        started = [
            spawn_router(free_port(), [e.url for e in engines], tenants, extra) for _ in range(n_routers)
        ]
        fleet = StaticFleet(
            [e.url for e in engines],
            [e.process for e in engines],
            started,
            redis_url,
            redis_proc,
            tenants,
            stack,
            extra,
        )
        try:
            for r in started:
                wait_http(r.url + "/health", r.process)
            sees_all = lambda: all(ready_engines(r.url) >= n_engines for r in started)  # noqa: E731
            until(sees_all, 60, "routers see every engine")
            yield fleet
        finally:
            stop([r.process for r in fleet.routers])
