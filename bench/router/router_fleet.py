"""Shared plumbing of the router benches: simulated engines, a router process, the workload.

Every bench here runs real processes: ``kvfleet engine --simulate`` (the real scheduler
and KV accounting on a timing model) as the fleet, ``kvfleet router`` (or vLLM's
``vllm-router``) in front, and drives them with ``kvfleet bench``'s load core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx

from kvfleet.bench.load import LoadSpec, new_session, stream_one
from kvfleet.bench.stats import BenchSummary, RequestRecord, summarize
from kvfleet.testing.processes import SimFlags as EngineFlags
from kvfleet.testing.processes import free_port, routers, sim_engines, stop, wait_http
from kvfleet.testing.processes import tenants_file as write_tenants

__all__ = ["EngineFlags", "free_port"]

KEY = "sk-bench-0123456789"


@contextlib.contextmanager
def engines(
    n: int, flags: EngineFlags, cpus: str | None = None, extra: Sequence[str] = ()
) -> Iterator[list[str]]:
    """``n`` simulated engines of the tiny model (``extra``: more engine flags); yields their base URLs."""
    with sim_engines(n, flags, extra, cpus=cpus) as started:
        yield [e.url for e in started]


def tenants_file(directory: Path, tenants: Sequence[tuple[str, str]] = (("bench", KEY),)) -> Path:
    return write_tenants(directory / "tenants.yaml", tenants)


class Front(NamedTuple):
    """A router process in front of the engines: its base URL and its process id."""

    url: str
    pid: int


def bodies(n: int, max_tokens: int) -> list[dict[str, object]]:
    """``n`` streamed completions of the tiny model, each generating exactly ``max_tokens``."""
    return [{"model": "tiny", "prompt": f"request {i}: the quick brown fox", "max_tokens": max_tokens,
             "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            for i in range(n)]  # fmt: skip


@contextlib.contextmanager
def kvfleet_front(urls: Sequence[str], extra: Sequence[str] = (), cpus: str | None = None) -> Iterator[Front]:
    """A ``kvfleet router`` process in front of ``urls``."""
    with tempfile.TemporaryDirectory() as tmp, routers(1, urls, tenants_file(Path(tmp)), extra, cpus) as r:
        yield Front(r[0].url, r[0].process.pid)  # taskset execs the router: same pid


@contextlib.contextmanager
def kvfleet_router(urls: Sequence[str], extra: Sequence[str] = (), cpus: str | None = None) -> Iterator[str]:
    """A ``kvfleet router`` process in front of ``urls``; yields its base URL."""
    with kvfleet_front(urls, extra, cpus) as front:
        yield front.url


@contextlib.contextmanager
def vllm_router(urls: Sequence[str], policy: str, cpus: str | None = None) -> Iterator[Front]:
    pin = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    port = free_port()
    argv = [*pin, binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--log-level", "warning", "--prometheus-port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc)
        yield Front(url, proc.pid)
    finally:
        stop([proc])


def overhead_args(description: str | None) -> argparse.Namespace:
    """The overhead benches' command line: a light run's requests, then a ceiling run's and its clients."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--ceiling-requests", type=int, default=600)
    ap.add_argument("--clients", type=int, default=32)
    return ap.parse_args()


@contextlib.contextmanager
def pinned_here(cpu: int) -> Iterator[None]:
    """This process (the load client) on ``cpu`` only, for the block."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def prefix_counts(urls: Sequence[str]) -> tuple[float, float]:
    """(hits, queries) summed over the engines' Prometheus counters."""
    hits = queries = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=5).text
        for name, value in re.findall(
            r"^(kvfleet_engine_prefix_cache_\w+_total)(?:\{[^}]*\})? (\S+)$", text, re.M
        ):
            if name.endswith("hits_total"):
                hits += float(value)
            elif name.endswith("queries_total"):
                queries += float(value)
    return hits, queries


@dataclass(frozen=True)
class ChatWorkload:
    """Chat requests whose system prompts come from ``groups`` long shared prefixes."""

    groups: int = 16
    prefix_words: int = 150
    question_words: int = 12
    max_tokens: int = 16
    seed: int = 0

    def bodies(self, n: int, model: str = "tiny") -> list[dict[str, object]]:
        rng = random.Random(self.seed)
        vocab = ["the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "was", "with", "as", "at"]
        systems = [
            " ".join(rng.choice(vocab) for _ in range(self.prefix_words)) + f" [{g}]"
            for g in range(self.groups)
        ]
        bodies: list[dict[str, object]] = []
        for _ in range(n):
            question = " ".join(rng.choice(vocab) for _ in range(self.question_words))
            bodies.append({
                "model": model, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True,
                "messages": [{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": question}],
            })  # fmt: skip
        return bodies


async def drive(
    url: str,
    bodies: Sequence[dict[str, object]],
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    endpoint: str = "chat",
    seed: int = 0,
    timeout_s: float = 120.0,
) -> tuple[list[RequestRecord], float]:
    """Send ``bodies`` open-loop at ``rate`` (Poisson) or closed-loop with ``concurrency`` clients."""
    spec = LoadSpec(
        url=url,
        model="tiny",
        endpoint=endpoint,  # type: ignore[arg-type]
        api_key=KEY,
        num_requests=len(bodies),
        timeout_s=timeout_s,
    )
    rng = random.Random(seed)
    async with new_session(timeout_s) as client:
        start = time.perf_counter()

        async def one(body: dict[str, object]) -> RequestRecord:
            return await stream_one(client, spec, dict(body), 0, time.perf_counter)

        if concurrency is not None:
            it = iter(bodies)
            records: list[RequestRecord] = []

            async def worker() -> None:
                for body in it:
                    records.append(await one(body))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            tasks, t = [], 0.0
            for body in bodies:
                delay = start + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(body)))
                t += rng.expovariate(rate) if rate else 0.0
            records = list(await asyncio.gather(*tasks))
        return records, time.perf_counter() - start


def summary(records: list[RequestRecord], duration: float, slo_ttft_s: float | None = None,
            slo_tpot_s: float | None = None) -> BenchSummary:  # fmt: skip
    return summarize(records, duration, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def header(title: str) -> str:
    cpu, load = os.cpu_count(), ", ".join(f"{x:.2f}" for x in os.getloadavg())
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"# {title}\n# {stamp}, {cpu} CPUs, load average {load}, simulated engines\n"
