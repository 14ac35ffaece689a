"""Router replicas sharing one quota through a real Redis server; Redis going away fails closed."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from .fakes import FakeEngine
from .test_proxy import KEY, router, tenant

AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "tiny", "prompt": "x", "max_tokens": 4}


async def test_two_routers_on_one_redis_admit_the_quota_once_not_twice(redis_server) -> None:
    limits = {"requestsPerMinute": 6}
    async with contextlib.AsyncExitStack() as stack:
        a, _ = await stack.enter_async_context(
            router([FakeEngine()], [tenant(**limits)], redis_url=redis_server.url)
        )
        b, _ = await stack.enter_async_context(
            router([FakeEngine()], [tenant(**limits)], redis_url=redis_server.url)
        )
        async with httpx.AsyncClient(timeout=30) as http:
            codes = await asyncio.gather(
                *(http.post(f"{(a, b)[i % 2]}/v1/completions", json=BODY, headers=AUTH) for i in range(20))
            )
    statuses = [r.status_code for r in codes]
    assert statuses.count(200) == 6 and statuses.count(429) == 14


async def test_with_redis_down_requests_are_refused_with_503_and_nothing_is_admitted(redis_server) -> None:
    async with router([FakeEngine()], [tenant(requestsPerMinute=100)], redis_url=redis_server.url) as (
        url,
        state,
    ):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.post("/v1/completions", json=BODY, headers=AUTH)).status_code == 200
            redis_server.stop()
            r = await http.post("/v1/completions", json=BODY, headers=AUTH)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "quota_store_unavailable"
        engine = next(iter(state.fleet.engines.values()))
        assert engine.in_flight == 0
        rejected = state.metrics.rejections.labels(
            model="tiny", tenant="alice", reason="quota_store_unavailable"
        )
        assert rejected._value.get() == 1
