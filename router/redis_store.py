"""Quotas shared by several router replicas, in one Redis (``--redis URL``, docs/architecture.md §6).

The same buckets as :class:`kvfleet.router.quota.MemoryQuotaStore`, kept in Redis
hashes and changed only inside Lua scripts, so a check-and-take is atomic across
replicas. Concurrency slots are members of a sorted set scored by their expiry
(``redis_lease_s``): a replica that dies without settling frees its slots when they
expire. The clock is the router's (passed as an argument), so replicas share
``time.time()``; tests pass a fake one.

The tenant's ``maxQueuedRequests`` is counted here too (:meth:`RedisQuotaStore.take`): a
request waiting in any replica's admission queue holds a slot in one sorted set, taken
by a Lua check-and-add, so the replicas together never queue more than the limit. The
Virtual Token Counters that order each queue stay per replica (docs/router.md, "Several
router replicas").

Redis unavailable: the router **fails closed**. Quotas are what keeps one tenant from
taking the fleet; admitting unmetered traffic while the shared state is gone would let
every replica admit a full quota each. :class:`QuotaUnavailable` becomes a 503 with
``Retry-After`` (code ``quota_store_unavailable``); requests already admitted finish.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvfleet.resources import TenantLimits
from kvfleet.router.quota import Charge, Clock, Denial, QuotaUnavailable

log = logging.getLogger(__name__)

# Invariant (both scripts): a bucket's level is min(cap, level + elapsed * cap / 60) before
# any change, and a request is taken only if every configured limit admits it.
_LUA_COMMON = """
local function refill(key, cap, now)
  if cap <= 0 then return nil end
  local level = tonumber(redis.call('HGET', key, 'level'))
  local stamp = tonumber(redis.call('HGET', key, 'stamp'))
  if level == nil then level = cap; stamp = now end
  if now > stamp then level = math.min(cap, level + (now - stamp) * cap / 60.0); stamp = now end
  if level > cap then level = cap end
  return {level, stamp}
end
local function store(key, b)
  redis.call('HSET', key, 'level', tostring(b[1]), 'stamp', tostring(b[2]))
  redis.call('EXPIRE', key, 3600)
end
"""

_ACQUIRE = (
    _LUA_COMMON
    + """
local now = tonumber(ARGV[1]); local rpm = tonumber(ARGV[2]); local tpm = tonumber(ARGV[3])
local maxc = tonumber(ARGV[4]); local cost = tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if maxc > 0 and redis.call('ZCARD', KEYS[3]) >= maxc then return {0, 'maxConcurrentRequests', '1'} end
local rb = refill(KEYS[1], rpm, now)
if rb and rb[1] < 1 then return {0, 'requestsPerMinute', tostring((1 - rb[1]) / (rpm / 60.0))} end
local tb = refill(KEYS[2], tpm, now)
if tb and tb[1] < cost then return {0, 'tokensPerMinute', tostring((cost - tb[1]) / (tpm / 60.0))} end
if rb then rb[1] = rb[1] - 1; store(KEYS[1], rb) end
if tb then tb[1] = tb[1] - cost; store(KEYS[2], tb) end
redis.call('ZADD', KEYS[3], tonumber(ARGV[7]), ARGV[6])
redis.call('EXPIRE', KEYS[3], math.ceil(tonumber(ARGV[7]) - now) + 60)
return {1, 'ok', '0'}
"""
)

_SETTLE = (
    _LUA_COMMON
    + """
local now = tonumber(ARGV[1]); local rpm = tonumber(ARGV[2]); local tpm = tonumber(ARGV[3])
local refund_tokens = tonumber(ARGV[4]); local refund_request = tonumber(ARGV[5])
redis.call('ZREM', KEYS[3], ARGV[6])
local tb = refill(KEYS[2], tpm, now)
if tb then tb[1] = math.min(tpm, tb[1] + refund_tokens); store(KEYS[2], tb) end
local rb = refill(KEYS[1], rpm, now)
if rb and refund_request > 0 then rb[1] = math.min(rpm, rb[1] + 1); store(KEYS[1], rb) end
return 1
"""
)

# Invariant: the set holds at most ``limit`` unexpired slots; a slot is taken only if it fits.
_TAKE_SLOT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], tonumber(ARGV[3]), ARGV[4])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) - tonumber(ARGV[1])) + 60)
return 1
"""

_LIMIT_VALUE = {
    "maxConcurrentRequests": lambda lim: lim.max_concurrent_requests,
    "requestsPerMinute": lambda lim: lim.requests_per_minute,
    "tokensPerMinute": lambda lim: lim.tokens_per_minute,
}


def _keys(prefix: str, tenant: str) -> list[str]:
    base = f"{prefix}:{{{tenant}}}"  # one hash slot per tenant (Redis Cluster friendly)
    return [f"{base}:requests", f"{base}:tokens", f"{base}:leases"]


@dataclass
class RedisQuotaStore:
    """The shared quota store; every method raises :class:`QuotaUnavailable` on Redis errors."""

    url: str
    clock: Clock
    lease_s: float = 900.0
    prefix: str = "kvfleet:quota"
    _client: aioredis.Redis = field(init=False)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _replica: str = field(default_factory=lambda: os.urandom(6).hex())

    def __post_init__(self) -> None:
        pool = aioredis.BlockingConnectionPool.from_url(
            self.url, max_connections=16, timeout=5.0, socket_timeout=5.0, socket_connect_timeout=5.0
        )
        self._client = aioredis.Redis(connection_pool=pool)
        self._acquire = self._client.register_script(_ACQUIRE)
        self._settle = self._client.register_script(_SETTLE)
        self._take_slot = self._client.register_script(_TAKE_SLOT)

    async def acquire(self, tenant: str, limits: TenantLimits, tokens: int) -> Charge | Denial:
        now = self.clock()
        lease = f"{self._replica}:{next(self._ids)}"
        args: list[float | str] = [now, limits.requests_per_minute or 0, limits.tokens_per_minute or 0]
        args += [limits.max_concurrent_requests or 0, tokens, lease, now + self.lease_s]
        try:
            ok, limit, wait = await self._acquire(keys=_keys(self.prefix, tenant), args=args)
        except RedisError as exc:
            raise QuotaUnavailable(f"quota store unreachable: {type(exc).__name__}") from exc
        if int(ok) == 1:
            return Charge(tenant=tenant, tokens=tokens, lease=lease)
        name = limit.decode() if isinstance(limit, bytes) else str(limit)
        return Denial(name, int(_LIMIT_VALUE[name](limits) or 0), float(wait))

    async def settle(self, charge: Charge, limits: TenantLimits, used_tokens: int | None) -> None:
        refund = charge.tokens - (0 if used_tokens is None else used_tokens)
        args: list[float | str] = [
            self.clock(),
            limits.requests_per_minute or 0,
            limits.tokens_per_minute or 0,
        ]
        args += [refund, 1 if used_tokens is None else 0, charge.lease]
        try:
            await self._settle(keys=_keys(self.prefix, charge.tenant), args=args)
        except RedisError as exc:
            raise QuotaUnavailable(f"quota store unreachable: {type(exc).__name__}") from exc

    async def take(self, tenant: str, limit: int, hold_s: float) -> str | None:
        """A queue slot of ``tenant``, counted across replicas (:class:`~kvfleet.router.admission.QueueSlots`)."""
        now = self.clock()
        slot = f"{self._replica}:q{next(self._ids)}"
        try:
            ok = await self._take_slot(keys=[self._queued_key(tenant)], args=[now, limit, now + hold_s, slot])
        except RedisError as exc:
            raise QuotaUnavailable(f"quota store unreachable: {type(exc).__name__}") from exc
        return slot if int(ok) == 1 else None

    async def give_back(self, tenant: str, slot: str) -> None:
        """Free a slot; with Redis gone, it expires by itself at the end of its hold."""
        try:
            await self._client.zrem(self._queued_key(tenant), slot)
        except RedisError as exc:
            log.warning("could not free a queue slot of tenant %s: %s", tenant, type(exc).__name__)

    async def queued(self, tenant: str) -> int:
        return int(await self._client.zcard(self._queued_key(tenant)))

    def _queued_key(self, tenant: str) -> str:
        return f"{self.prefix}:{{{tenant}}}:queued"

    async def in_flight(self, tenant: str) -> int:
        return int(await self._client.zcard(_keys(self.prefix, tenant)[2]))

    async def close(self) -> None:
        await self._client.aclose()
