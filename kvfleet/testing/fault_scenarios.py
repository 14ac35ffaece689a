"""The faults, one function each: break a fleet under a multi-tenant load, return what it cost.

Where it sits: ``e2e/test_faults.py`` asserts on each :class:`FaultRun` (nothing lost, clean
error shapes, every quota charge settled), ``bench/router/faults.py`` prints them as one table.
Each function takes a running fleet (:mod:`kvfleet.testing.faults`), starts a
:class:`~kvfleet.testing.fault_load.BackgroundLoad`, waits until a few requests have ended,
injects its fault, and measures ``heal_s``: from the fault (or its end, where the fault is
held on purpose) until the fleet serves as before.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import orjson

from kvfleet.testing.fault_load import BackgroundLoad, LoadSpec, Tally, Tenant, completion_body
from kvfleet.testing.faults import (
    STALL_S,
    TENANTS,
    LocalUp,
    StaticFleet,
    engine_running,
    quota_held,
    ready_engines,
    settled,
    until,
)


@dataclass
class FaultRun:
    fault: str
    tally: Tally
    heal_s: float | None  # seconds until the fleet served as before
    held: tuple[float, float]  # (requests, tokens) still holding quota on the routers after the load
    facts: dict[str, float | str] = field(default_factory=dict)  # what the test asserts besides the counts

    def row(self) -> str:
        t = self.tally
        heal = "-" if self.heal_s is None else f"{self.heal_s:.1f}"
        return (
            f"{self.fault:<34}{t.accepted:>9}{t.count('completed'):>10}{t.count('clean_error'):>7}"
            f"{t.count('refused'):>8}{len(t.lost):>5}{heal:>8}   {_codes(t)}"
        )


HEADER = f"{'fault':<34}{'accepted':>9}{'completed':>10}{'clean':>7}{'refused':>8}{'lost':>5}{'heal s':>8}   clean errors"


def _codes(t: Tally) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(t.error_codes().items())) or "-"


def _load(urls: list[str], requests: int = 48, max_tokens: int = 40) -> BackgroundLoad:
    return BackgroundLoad(LoadSpec(urls, TENANTS, requests=requests, concurrency=6, max_tokens=max_tokens))


def engine_sigkill(up: LocalUp) -> FaultRun:
    """An engine's API process SIGKILLed mid-stream; ``kvfleet up`` replaces it."""
    load = _load([up.url])
    load.wait_for(8)
    victim, pid = sorted(up.engines().items())[0]
    os.kill(pid, signal.SIGKILL)
    out_s = until(lambda: ready_engines(up.url) <= 1, 30, "the router takes the dead engine out")
    heal = out_s + until(lambda: ready_engines(up.url) >= 2 and victim not in up.engines(), 120, "replaced")
    tally = load.result()
    return FaultRun("engine SIGKILLed mid-stream", tally, heal, settled([up.url]), {"out_s": out_s})


def engine_sigstop(fleet: StaticFleet, hold_s: float = 5.0) -> FaultRun:
    """An engine that hangs (SIGSTOP) for ``hold_s``, then SIGCONT; nobody restarts it."""
    load = _load(fleet.router_urls)
    load.wait_for(8)
    proc = fleet.engine_procs[0]
    proc.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        out_s = until(
            lambda: all(ready_engines(u) <= 1 for u in fleet.router_urls), 30, "the hung engine out"
        )
        time.sleep(max(0.0, hold_s - (time.monotonic() - stopped)))
    finally:
        proc.send_signal(signal.SIGCONT)
    heal = until(lambda: all(ready_engines(u) >= 2 for u in fleet.router_urls), 60, "the engine back")
    tally = load.result()
    return FaultRun(
        "engine hung (SIGSTOP, then SIGCONT)",
        tally,
        heal,
        settled(fleet.router_urls),
        {"out_s": out_s, "leases": sum(fleet.redis_leases().values())},
    )


def rolling_restart(up: LocalUp) -> FaultRun:
    """SIGHUP to ``kvfleet up``: every engine replaced, one at a time, the old one drained."""
    before = set(up.engines().values())
    load = BackgroundLoad(LoadSpec([up.url], TENANTS, requests=100_000, concurrency=6, max_tokens=40))
    load.wait_for(6)
    up.process.send_signal(signal.SIGHUP)
    heal = until(lambda: "rolling restart: done" in up.log_text(), 180, "the rolling restart")
    load.wait_for(load.done + 6)  # the new engines serve the load for a while
    tally = load.result(stop=True)
    replaced = len(before - set(up.engines().values()))
    return FaultRun("rolling restart, every engine", tally, heal, settled([up.url]), {"replaced": replaced})


def local_restart(up: LocalUp) -> FaultRun:
    """``kvfleet up`` (its router in-process, memory quotas) SIGTERMed under load and started again."""
    load = _load([up.url], requests=60)
    load.wait_for(8)
    up.stop()
    start = time.monotonic()
    up.start()
    heal = time.monotonic() - start
    tally = load.result()
    return FaultRun("kvfleet up restarted (its router)", tally, heal, settled([up.url]))


def router_restart(fleet: StaticFleet) -> FaultRun:
    """One of two router replicas (on one Redis) SIGTERMed under load and started again on its port."""
    load = _load(fleet.router_urls, requests=60)
    load.wait_for(8)
    heal = fleet.restart_router(0)
    tally = load.result()
    held = settled(fleet.router_urls)
    return FaultRun(
        "router replica restarted (Redis)", tally, heal, held, {"leases": sum(fleet.redis_leases().values())}
    )


def redis_restart(fleet: StaticFleet, down_s: float = 2.0) -> FaultRun:
    """Redis stopped for ``down_s`` under load, then started again (empty): the routers fail closed, then recover."""
    load = _load(fleet.router_urls, requests=60)
    load.wait_for(8)
    fleet.stop_redis()
    time.sleep(down_s)
    fleet.start_redis()
    probe = Tenant(*TENANTS[0])
    heal = until(lambda: all(_serves(u, probe) for u in fleet.router_urls), 60, "the routers recover")
    tally = load.result()
    held = settled(fleet.router_urls)
    return FaultRun(
        "Redis stopped, then restarted", tally, heal, held, {"leases": sum(fleet.redis_leases().values())}
    )


def _serves(url: str, tenant: Tenant) -> bool:
    import httpx

    body = {"model": "tiny", "prompt": "probe", "max_tokens": 1}
    try:
        r = httpx.post(
            f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=10
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200


class SlowClient:
    """A client that sends one streamed completion, reads the response's first bytes, then reads nothing."""

    def __init__(self, url: str, body: dict[str, object], api_key: str | None = None) -> None:
        parts = urlsplit(url)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: back-pressure soon
        self.sock.connect((parts.hostname, parts.port))
        payload = orjson.dumps(body)
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n{auth}\r\n"
        )
        self.sock.sendall(head.encode() + payload)
        self.sock.settimeout(30)
        self.first = self.sock.recv(1024)

    def close(self) -> None:
        self.sock.close()


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` (KiB), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def slow_client(up: LocalUp, max_tokens: int = 6000) -> FaultRun:
    """A client of the router and one of an engine that never read their streams, beside a normal load."""
    engine_url = "http://" + sorted(up.engines())[0]
    engine_pid = up.engines()[engine_url.removeprefix("http://")]
    rss_before = (rss_kib(up.process.pid), rss_kib(engine_pid))
    body = completion_body("tiny", max_tokens, "a stream nobody reads")
    start = time.monotonic()
    slow = [SlowClient(up.url, body, TENANTS[0].key), SlowClient(engine_url, body)]
    try:
        load = _load([up.url], requests=24)
        tally = load.result()
        until(
            lambda: quota_held(up.url) == (0.0, 0.0) and engine_running(engine_url) == 0,
            60,
            "the unread streams aborted, their quota settled",
        )
        heal = time.monotonic() - start
        rss_after = (rss_kib(up.process.pid), rss_kib(engine_pid))
    finally:
        for s in slow:
            s.close()
    facts: dict[str, float | str] = {
        "first_bytes": " | ".join(s.first.split(b"\r\n", 1)[0].decode(errors="replace") for s in slow),
        "stalls_logged": up.log_text().count("a client read nothing of its stream"),
        "router_rss_kib": f"{rss_before[0]} -> {rss_after[0]}",
        "engine_rss_kib": f"{rss_before[1]} -> {rss_after[1]}",
        "bound_s": STALL_S,
    }
    return FaultRun("client that never reads its stream", tally, heal, settled([up.url]), facts)
