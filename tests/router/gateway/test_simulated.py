"""``kvfleet router --envoy-xds-port`` in front of real ``kvfleet engine --simulate`` processes, via Envoy.

Every part is a real process, as a user runs them: two simulated engines, the router
(which writes Envoy's bootstrap), the Envoy binary. The evidence of where a request
went is the engines' own Prometheus counters: only the engine the router named in
``x-kvfleet-engine`` counts the tokens the client was sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio

from kvfleet.router.gateway import xds
from kvfleet.router.gateway.process import EnvoyProcess
from kvfleet.router.gateway_config import GatewayConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sk-sim-0123456789"
KVFLEET = [sys.executable, "-m", "kvfleet.cli"]


@dataclass
class SimStack:
    envoy: EnvoyProcess
    router: str  # the router's own base URL (its /metrics)
    engines: list[str]  # base URLs
    bootstrap: Path


def engine_command(port: int) -> list[str]:
    flags = ["--max-num-seqs", "8", "--num-kv-blocks", "256", "--sim-base-ms", "2", "--sim-per-token-ms", "0"]
    return [*KVFLEET, "engine", "--simulate", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", *flags]  # fmt: skip


def router_command(engines: list[str], port: int, gw: GatewayConfig, tmp: Path) -> list[str]:
    (tmp / "tenants.yaml").write_text(f"tenants:\n  - tenant: sim\n    apiKey: {KEY}\n")
    return [*KVFLEET, "router", "--engines", ",".join(engines), "--port", str(port),
            "--tenants", str(tmp / "tenants.yaml"), "--envoy-xds-port", str(gw.xds_port),
            "--envoy-port", str(gw.listen_port), "--envoy-admin-port", str(gw.admin_port),
            "--envoy-bootstrap", str(tmp / "envoy.json")]  # fmt: skip


async def wait_until(
    url: str, process: subprocess.Popen[bytes], ok: Callable[[httpx.Response], bool]
) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(1200):
            assert process.poll() is None, f"{process.args!r} exited with {process.returncode}"
            try:
                if ok(await http.get(url, timeout=1)):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} not up in 60 s")


def counter(text: str, name: str) -> float:
    """A counter's value in a Prometheus exposition (0 before it was first incremented)."""
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def metric(url: str, name: str) -> float:
    async with httpx.AsyncClient() as http:
        return counter((await http.get(url + "/metrics")).text, name)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def sim(
    free_port_module: Callable[[], int], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SimStack]:
    tmp = tmp_path_factory.mktemp("sim")
    ports = [free_port_module(), free_port_module()]
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    gw = GatewayConfig(
        xds_port=free_port_module(), listen_port=free_port_module(), admin_port=free_port_module()
    )
    router_port = free_port_module()
    router_url = f"http://127.0.0.1:{router_port}"
    processes = [subprocess.Popen(engine_command(p), stdout=subprocess.DEVNULL) for p in ports]
    processes.append(
        subprocess.Popen(router_command(engines, router_port, gw, tmp), stdout=subprocess.DEVNULL)
    )
    try:
        await asyncio.gather(*(wait_until(u + "/health", p, lambda r: r.status_code == 200)
                               for u, p in zip(engines, processes, strict=False)))  # fmt: skip
        await wait_until(
            router_url + "/ready", processes[-1], lambda r: r.json()["ready_engines"] == {"tiny": 2}
        )
        envoy = EnvoyProcess(gw)
        await asyncio.to_thread(envoy.start)  # returns once the router's ADS has configured it
        try:
            yield SimStack(envoy, router_url, engines, tmp / "envoy.json")
        finally:
            await asyncio.to_thread(envoy.stop)
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            p.wait(timeout=20)


async def test_the_router_wrote_the_bootstrap_envoy_started_from(sim: SimStack) -> None:
    assert json.loads(sim.bootstrap.read_text()) == xds.bootstrap_json(sim.envoy.config)


async def test_a_chat_stream_comes_from_the_engine_the_router_named_with_its_real_usage(
    sim: SimStack,
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{sim.envoy.url}/v1", api_key=KEY, max_retries=0)
    tokens = "kvfleet_engine_generation_tokens_total"
    before = {u: await metric(u, tokens) for u in sim.engines}
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chosen = "http://" + raw.headers["x-kvfleet-engine"]
    chunks = [c async for c in raw.parse()]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    after = {u: await metric(u, tokens) for u in sim.engines}
    assert usage.completion_tokens == 6
    assert len(text) > 0
    assert {u: after[u] - before[u] for u in sim.engines} == {
        u: 6.0 if u == chosen else 0.0 for u in sim.engines
    }
    assert await metric(sim.router, "kvfleet_router_generation_tokens_total") == 6  # the router accounted it


async def test_a_completion_without_streaming_carries_the_engines_usage_through_envoy(sim: SimStack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{sim.envoy.url}/v1", api_key=KEY, max_retries=0)
    completion = await client.completions.create(
        model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 3)
    assert completion.choices[0].finish_reason == "length"
