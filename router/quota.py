"""Per-tenant quotas, the second step of the request path (docs/architecture.md §6).

A request is charged at admission: one request from the requests-per-minute bucket,
its *estimated* tokens (prompt estimate + max_tokens) from the tokens-per-minute
bucket, and one concurrency slot. When it ends, :meth:`QuotaStore.settle` corrects
the token bucket with the usage the engine reported and frees the slot; a request
that failed on the fleet's side is refunded in full. ``maxQueuedRequests`` is not
here: it bounds the router's own queue (:mod:`kvfleet.router.admission`).

Two stores implement :class:`QuotaStore`: :class:`MemoryQuotaStore` for one replica
and :class:`kvfleet.router.redis_store.RedisQuotaStore` for replicas sharing one quota.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvfleet.resources import TenantLimits

Clock = Callable[[], float]


@dataclass(frozen=True)
class Charge:
    """What a request holds while it is in the system."""

    tenant: str
    tokens: int
    lease: str


@dataclass(frozen=True)
class Denial:
    """A quota said no: which limit (TenantQuota field name), and when to retry."""

    limit: str
    value: int
    retry_after_s: float

    @property
    def message(self) -> str:
        return f"tenant over its quota: {self.limit}={self.value}; retry after {self.retry_after_s:.1f}s"


class QuotaUnavailable(Exception):
    """The shared quota state could not be reached (the router fails closed: 503)."""


class QuotaStore(Protocol):
    async def acquire(self, tenant: str, limits: TenantLimits, tokens: int) -> Charge | Denial: ...

    async def settle(self, charge: Charge, limits: TenantLimits, used_tokens: int | None) -> None:
        """Free the slot; correct tokens to ``used_tokens``, or refund all when None."""
        ...

    async def close(self) -> None: ...


@dataclass
class TokenBucket:
    """A bucket of ``capacity`` refilled at ``capacity`` per minute.

    Invariant: ``level(t) = min(capacity, level(t0) + (t - t0) * capacity / 60)``; only
    a correction (usage above the estimate) takes it below zero, as a debt repaid by refill.
    """

    capacity: int
    level: float
    stamp: float

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        self.level = min(float(self.capacity), self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)

    def shortfall_s(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` fits (0.0: it fits now)."""
        self.refill(now)
        return 0.0 if self.level >= cost else (cost - self.level) / self.rate

    def add(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(float(self.capacity), self.level + amount)


@dataclass
class _TenantState:
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    in_flight: int = 0


def _bucket(existing: TokenBucket | None, capacity: int | None, now: float) -> TokenBucket | None:
    if capacity is None:
        return None
    if existing is None or existing.capacity != capacity:
        level = float(capacity) if existing is None else min(existing.level, float(capacity))
        return TokenBucket(capacity=capacity, level=level, stamp=now)
    return existing


@dataclass
class MemoryQuotaStore:
    """Quotas of one router replica, in memory, on an injectable clock."""

    clock: Clock
    _state: dict[str, _TenantState] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def _tenant(self, tenant: str, limits: TenantLimits, now: float) -> _TenantState:
        st = self._state.setdefault(tenant, _TenantState())
        st.requests = _bucket(st.requests, limits.requests_per_minute, now)
        st.tokens = _bucket(st.tokens, limits.tokens_per_minute, now)
        return st

    async def acquire(self, tenant: str, limits: TenantLimits, tokens: int) -> Charge | Denial:
        now = self.clock()
        st = self._tenant(tenant, limits, now)
        if limits.max_concurrent_requests is not None and st.in_flight >= limits.max_concurrent_requests:
            return Denial("maxConcurrentRequests", limits.max_concurrent_requests, 1.0)
        if st.requests is not None and (wait := st.requests.shortfall_s(1, now)) > 0:
            return Denial("requestsPerMinute", st.requests.capacity, wait)
        if st.tokens is not None and (wait := st.tokens.shortfall_s(tokens, now)) > 0:
            return Denial("tokensPerMinute", st.tokens.capacity, wait)
        if st.requests is not None:
            st.requests.level -= 1
        if st.tokens is not None:
            st.tokens.level -= tokens
        st.in_flight += 1
        return Charge(tenant=tenant, tokens=tokens, lease=f"{tenant}:{next(self._ids)}")

    async def settle(self, charge: Charge, limits: TenantLimits, used_tokens: int | None) -> None:
        now = self.clock()
        st = self._tenant(charge.tenant, limits, now)
        st.in_flight = max(0, st.in_flight - 1)
        if st.tokens is not None:
            st.tokens.add(charge.tokens - (0 if used_tokens is None else used_tokens), now)
        if used_tokens is None and st.requests is not None:
            st.requests.add(1, now)

    def in_flight(self, tenant: str) -> int:
        st = self._state.get(tenant)
        return 0 if st is None else st.in_flight

    async def close(self) -> None:
        return None
