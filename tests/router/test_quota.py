"""Token buckets, concurrency slots and their correction, on a fake clock, in memory and in Redis."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.router.config import TenantLimits
from kvfleet.router.quota import Charge, Denial, MemoryQuotaStore, QuotaStore, QuotaUnavailable
from kvfleet.router.redis_store import RedisQuotaStore

LIMITS = TenantLimits(requestsPerMinute=60, tokensPerMinute=600, maxConcurrentRequests=3)


@pytest.fixture(params=["memory", "redis"])
async def store(request, clock):
    if request.param == "memory":
        yield MemoryQuotaStore(clock=clock)
    else:
        server = request.getfixturevalue("redis_server")
        s = RedisQuotaStore(url=server.url, clock=clock)
        yield s
        await s.close()


async def test_the_requests_bucket_empties_then_refills_one_per_second_at_sixty_per_minute(store, clock):
    limits = TenantLimits(requestsPerMinute=60)
    grants = [await store.acquire("a", limits, 0) for _ in range(61)]
    assert all(isinstance(g, Charge) for g in grants[:60])
    denial = grants[60]
    assert denial == Denial("requestsPerMinute", 60, 1.0)
    clock.advance(0.5)
    assert await store.acquire("a", limits, 0) == Denial("requestsPerMinute", 60, 0.5)
    clock.advance(0.5)
    assert isinstance(await store.acquire("a", limits, 0), Charge)


async def test_tokens_are_charged_by_estimate_and_corrected_by_reported_usage(store, clock):
    limits = TenantLimits(tokensPerMinute=600)
    first = await store.acquire("a", limits, 500)
    assert isinstance(first, Charge)
    # 100 left: a 200-token estimate must wait (200-100)/10 per second = 10 s
    assert await store.acquire("a", limits, 200) == Denial("tokensPerMinute", 600, 10.0)
    await store.settle(first, limits, used_tokens=150)  # 350 refunded: level 450
    assert isinstance(await store.acquire("a", limits, 450), Charge)
    assert await store.acquire("a", limits, 1) == Denial("tokensPerMinute", 600, 0.1)


async def test_usage_above_the_estimate_becomes_a_debt_repaid_by_refill(store, clock):
    limits = TenantLimits(tokensPerMinute=600)
    charge = await store.acquire("a", limits, 600)
    await store.settle(charge, limits, used_tokens=700)  # level -100
    assert await store.acquire("a", limits, 100) == Denial("tokensPerMinute", 600, 20.0)
    clock.advance(20.0)
    assert isinstance(await store.acquire("a", limits, 100), Charge)


async def test_concurrency_slots_are_freed_by_settle_and_a_failed_request_is_refunded(store, clock):
    charges = [await store.acquire("a", LIMITS, 100) for _ in range(3)]
    assert all(isinstance(c, Charge) for c in charges)
    assert await store.acquire("a", LIMITS, 100) == Denial("maxConcurrentRequests", 3, 1.0)
    await store.settle(charges[0], LIMITS, used_tokens=None)  # refunds 100 tokens and the request
    again = await store.acquire("a", LIMITS, 400)
    assert isinstance(again, Charge)
    assert await store.acquire("b", LIMITS, 600) != await store.acquire("a", LIMITS, 1)


async def test_tenants_have_separate_buckets(store, clock):
    limits = TenantLimits(requestsPerMinute=1)
    assert isinstance(await store.acquire("a", limits, 0), Charge)
    assert isinstance(await store.acquire("b", limits, 0), Charge)
    assert await store.acquire("a", limits, 0) == Denial("requestsPerMinute", 1, 60.0)


async def test_a_denial_names_the_limit_and_its_value():
    assert Denial("tokensPerMinute", 600, 2.5).message == (
        "tenant over its quota: tokensPerMinute=600; retry after 2.5s"
    )


async def test_redis_replicas_sharing_one_store_never_admit_more_than_the_quota(redis_server, clock):
    limits = TenantLimits(requestsPerMinute=50, maxConcurrentRequests=1000)
    replicas: list[QuotaStore] = [RedisQuotaStore(url=redis_server.url, clock=clock) for _ in range(4)]
    results = await asyncio.gather(*(replicas[i % 4].acquire("a", limits, 0) for i in range(200)))
    assert sum(isinstance(r, Charge) for r in results) == 50
    for r in replicas:
        await r.close()


async def test_a_redis_slot_of_a_replica_that_died_expires_after_its_lease(redis_server, clock):
    limits = TenantLimits(maxConcurrentRequests=1)
    dead = RedisQuotaStore(url=redis_server.url, clock=clock, lease_s=30.0)
    alive = RedisQuotaStore(url=redis_server.url, clock=clock, lease_s=30.0)
    assert isinstance(await dead.acquire("a", limits, 0), Charge)
    assert await alive.acquire("a", limits, 0) == Denial("maxConcurrentRequests", 1, 1.0)
    clock.advance(31.0)
    assert isinstance(await alive.acquire("a", limits, 0), Charge)
    await dead.close()
    await alive.close()


async def test_an_unreachable_redis_raises_quota_unavailable(redis_server, clock):
    store = RedisQuotaStore(url=redis_server.url, clock=clock)
    redis_server.stop()
    with pytest.raises(QuotaUnavailable, match="quota store unreachable"):
        await store.acquire("a", LIMITS, 1)
    await store.close()
