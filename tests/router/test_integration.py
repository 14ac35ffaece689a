"""The router in front of real simulated engines (``kvfleet engine --simulate``), as a user meets it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import redis.asyncio as aioredis

from kvfleet.router.app import build_app
from kvfleet.router.config import RouterConfig, TenantEntry
from kvfleet.testing.processes import SimFlags, free_port, router_processes, sim_engines

from .fakes import FakeEngine, served

KEY = "sk-alice-0123456789"
SIM = SimFlags(max_num_seqs=8, num_kv_blocks=256, base_ms=5.0, max_model_len=2048)
FLEET = (3, SIM)  # the conftest's fleet


def alice(**limits: Any) -> TenantEntry:
    return TenantEntry.model_validate({"tenant": "alice", "apiKey": KEY, "limits": limits})


@contextlib.asynccontextmanager
async def in_process_router(
    urls: list[str], *others: TenantEntry, **cfg: Any
) -> AsyncIterator[tuple[str, Any]]:
    """A router on ``urls`` for alice (her ``limits`` in ``cfg``) and ``others``, once every engine is ready."""
    config = RouterConfig(engines=urls, tenants=[alice(**cfg.pop("limits", {})), *others], load_interval_s=0.05,
                          load_stale_s=5.0, **cfg)  # fmt: skip
    app = build_app(config)
    async with served(app, free_port()) as url:
        state = app.state.router
        for _ in range(500):
            if all(state.fleet.is_ready(e) for e in state.fleet.engines.values()):
                break
            await asyncio.sleep(0.02)
        yield url, state


async def test_the_openai_client_streams_chat_through_the_router_and_real_usage_is_accounted(fleet) -> None:
    async with in_process_router(fleet) as (url, state):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello there"}],
            stream=True,
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        assert all(c.usage is None for c in chunks), "the usage chunk the router asked for is not passed on"
        m = state.metrics
        assert m.generation_tokens.labels(model="tiny", tenant="alice")._value.get() == 6
        assert m.prompt_tokens.labels(model="tiny", tenant="alice")._value.get() > 0
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]


async def test_requests_sharing_a_prefix_go_to_the_engine_that_has_it(fleet) -> None:
    system = "You are a careful assistant. " * 12
    async with in_process_router(fleet, prefix_chunk_chars=16) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        engines = []
        for question in ["one?", "two?", "three?", "four?"]:
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", max_tokens=2,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            )  # fmt: skip
            engines.append(raw.headers["x-kvfleet-engine"])
        assert len(set(engines)) == 1, engines
        other = await client.completions.with_raw_response.create(
            model="tiny", prompt="unrelated", max_tokens=2
        )
        assert other.headers["x-kvfleet-engine"] != engines[0], "a cold prompt goes to a less busy engine"


async def test_an_engine_killed_mid_stream_gives_an_error_event_and_no_new_requests() -> None:
    with sim_engines(
        2, SimFlags(max_num_seqs=8, num_kv_blocks=256, base_ms=40.0, max_model_len=2048)
    ) as fleet:
        urls = [u for u, _ in fleet]
        async with (
            in_process_router(urls, limits={"maxConcurrentRequests": 4}) as (url, state),
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            body = {"model": "tiny", "prompt": "x", "stream": True, "max_tokens": 200, "ignore_eos": True}
            auth = {"Authorization": f"Bearer {KEY}"}
            async with http.stream("POST", "/v1/completions", json=body, headers=auth) as r:
                victim = "http://" + r.headers["x-kvfleet-engine"]
                lines = r.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: {")
                dict(fleet)[victim].send_signal(signal.SIGKILL)
                rest = [line async for line in lines if line]
            assert '"code": "engine_failed"' in rest[-2] and rest[-1] == "data: [DONE]"
            assert state.quota.in_flight("alice") == 0
            for _ in range(4):
                ok = await http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                                     headers=auth)  # fmt: skip
                assert ok.status_code == 200
                assert "http://" + ok.headers["x-kvfleet-engine"] != victim


BOB = "sk-bob-0123456789"
TWO_TENANTS = f"""tenants:
  - tenant: alice
    apiKey: {KEY}
    limits: {{requestsPerMinute: 12}}
  - tenant: bob
    apiKey: {BOB}
    limits: {{maxQueuedRequests: 3}}
"""


async def test_two_router_processes_on_one_redis_share_one_request_quota_and_one_queue_limit(
    fleet, redis_server, tmp_path: Path
) -> None:
    full = FakeEngine(model="full", load={"num_running": 1, "max_num_seqs": 1})  # saturated: requests queue
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TWO_TENANTS)
    extra = ["--redis", redis_server.url, "--max-engine-queue", "0", "--max-queue-wait", "30"]
    async with served(full.app(), free_port()) as engine, contextlib.AsyncExitStack() as stack:
        processes = router_processes(2, [*fleet, engine], tenants, extra)
        routers = await asyncio.to_thread(processes.__enter__)
        stack.push_async_callback(asyncio.to_thread, processes.__exit__, None, None, None)
        fresh = httpx.Limits(max_keepalive_connections=0)  # no idle connection the server may have closed
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=60, limits=fresh))
        await _alice_gets_the_quota_once(http, routers)
        await _bob_queues_at_most_three_in_total(http, routers, full, redis_server.url)


async def _alice_gets_the_quota_once(http: httpx.AsyncClient, routers: list[str]) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    auth = {"Authorization": f"Bearer {KEY}"}
    responses = await asyncio.gather(
        *(http.post(f"{routers[i % 2]}/v1/completions", json=body, headers=auth) for i in range(40))
    )
    codes = [r.status_code for r in responses]
    # 12 per minute refills one every 5 s: a run this short gets the burst of 12 and at most a refill or two
    assert 12 <= codes.count(200) <= 14 and codes.count(200) + codes.count(429) == 40
    assert all(r.headers["retry-after"] for r in responses if r.status_code == 429)


async def _bob_queues_at_most_three_in_total(
    http: httpx.AsyncClient, routers: list[str], full: FakeEngine, redis_url: str
) -> None:
    body = {"model": "full", "prompt": "x", "max_tokens": 2}
    auth = {"Authorization": f"Bearer {BOB}"}
    sends = [
        asyncio.ensure_future(http.post(f"{routers[i % 2]}/v1/completions", json=body, headers=auth))
        for i in range(20)
    ]
    for answered, next_done in enumerate(asyncio.as_completed(sends), start=1):
        await next_done
        if answered == 17:  # everyone but the three the replicas may queue between them
            break
    queued = [s for s in sends if not s.done()]
    shed = [s.result() for s in sends if s.done()]
    assert len(queued) == 3
    assert [r.status_code for r in shed] == [429] * 17
    assert {r.json()["error"]["code"] for r in shed} == {"tenant_queue_full"}
    client = aioredis.Redis.from_url(redis_url)
    assert await client.zcard("kvfleet:quota:{bob}:queued") == 3
    await client.aclose()
    for _ in range(100):  # bounded: each replica sets its gauge as its queue changes, a moment after redis
        depths = [await queue_depth(http, url, "full") for url in routers]
        if sum(depths) == 3:
            break
        await asyncio.sleep(0.05)
    assert sum(depths) == 3, depths
    full.load = {"max_num_seqs": 1}  # room again: the queued three go, one at a time
    assert [r.status_code for r in await asyncio.gather(*queued)] == [200, 200, 200]


async def queue_depth(http: httpx.AsyncClient, router: str, model: str) -> float:
    text = (await http.get(f"{router}/metrics")).text
    line = next(
        x for x in text.splitlines() if x.startswith(f'kvfleet_router_queue_depth{{model="{model}"}}')
    )
    return float(line.split()[-1])
