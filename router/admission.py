"""Admission, step three of the request path: the router's queue in front of a model (docs/architecture.md §6).

A request whose model has an unsaturated engine goes at once. Otherwise it waits in
the model's queue until :meth:`AdmissionQueue.pump` (called whenever a request ends
or fresh load arrives) can place it. The next request out is chosen by the tenant's
priority (higher first), then by the Virtual Token Counter of Sheng et al., "Fairness
in Serving Large Language Models" (OSDI '24): each tenant's counter grows by the
tokens it was served (prompt + completion) divided by its weight, and the backlogged
tenant with the smallest counter goes next, FIFO within a tenant. Fair share is thus
counted in tokens, so a tenant of long requests cannot crowd out one of short ones.

Every waiter has a deadline; a full queue (model-wide or the tenant's
``maxQueuedRequests``) sheds at once with 429, a passed deadline with 503, both with
``Retry-After``. With :class:`QueueSlots` (the Redis store, for several replicas), a
waiter holds one of its tenant's slots, counted across replicas, for as long as it waits.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

P = TypeVar("P")


@dataclass(frozen=True)
class Shed(Exception):
    """The queue refused or dropped a request."""

    reason: str  # queue_full | tenant_queue_full | deadline
    status: int
    retry_after_s: float
    message: str


class QueueSlots(Protocol):
    """Tenants' queue slots shared by router replicas (``maxQueuedRequests`` across all of them)."""

    async def take(self, tenant: str, limit: int, hold_s: float) -> str | None:
        """A slot held at most ``hold_s``, or None when ``limit`` are taken."""
        ...

    async def give_back(self, tenant: str, slot: str) -> None:
        """Free ``slot``; never raises (a slot that cannot be freed expires)."""
        ...


class VirtualTokenCounter:
    """Per-tenant counters of weighted tokens served (Sheng et al., Algorithm 2)."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.last_left: str | None = None

    def charge(self, tenant: str, tokens: float, weight: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / weight

    def lift(self, tenant: str, backlogged: list[str]) -> None:
        # Invariant: a tenant joining the backlog starts no lower than the least-served backlogged
        # tenant (or the last one to leave when none is), so idle time is never banked as credit.
        floor = [self.counters.get(t, 0.0) for t in backlogged if t != tenant]
        if not floor and self.last_left is not None and self.last_left != tenant:
            floor = [self.counters.get(self.last_left, 0.0)]
        if floor:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(floor))

    def value(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)


@dataclass
class Ticket(Generic[P]):
    """One waiting request; ``place`` reserves an engine or returns None when all are full."""

    tenant: str
    priority: int
    weight: float
    tokens: int
    place: Callable[[], P | None]
    max_queued: int | None = None
    seq: int = 0
    future: asyncio.Future[P] | None = None


@dataclass
class AdmissionQueue(Generic[P]):
    """The queue of one model."""

    max_len: int
    max_wait_s: float
    vtc: VirtualTokenCounter = field(default_factory=VirtualTokenCounter)
    on_dispatch: Callable[[Ticket[P]], None] | None = None
    release: Callable[[P], None] | None = None
    slots: QueueSlots | None = None
    _queues: dict[str, deque[Ticket[P]]] = field(default_factory=dict)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queued(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    async def admit(self, ticket: Ticket[P], deadline_s: float | None = None) -> P:
        """Return the placement, at once or after waiting; raise :class:`Shed` otherwise."""
        if not len(self):
            placed = ticket.place()
            if placed is not None:
                self._dispatched(ticket)
                return placed
        timeout = self.max_wait_s if deadline_s is None else deadline_s
        slot = await self._take_slot(ticket, timeout)
        try:
            return await self._wait(ticket, timeout)
        finally:
            if slot is not None and self.slots is not None:
                await asyncio.shield(self.slots.give_back(ticket.tenant, slot))

    async def _take_slot(self, ticket: Ticket[P], timeout: float) -> str | None:
        if self.slots is None or ticket.max_queued is None:
            return None
        slot = await self.slots.take(ticket.tenant, ticket.max_queued, timeout + 30.0)
        if slot is None:
            raise Shed("tenant_queue_full", 429, 1.0, self._tenant_full(ticket))
        return slot

    @staticmethod
    def _tenant_full(ticket: Ticket[P]) -> str:
        return f"tenant over its quota: maxQueuedRequests={ticket.max_queued}"

    async def _wait(self, ticket: Ticket[P], timeout: float) -> P:
        self._enqueue(ticket)
        assert ticket.future is not None
        try:
            return await asyncio.wait_for(asyncio.shield(ticket.future), timeout)
        except TimeoutError:
            if ticket.future.done() and not ticket.future.cancelled():
                return ticket.future.result()
            self._remove(ticket)
            raise Shed(
                "deadline", 503, timeout, f"no engine free within the {timeout:.1f}s deadline"
            ) from None
        except asyncio.CancelledError:
            self._remove(ticket)
            if ticket.future.done() and not ticket.future.cancelled() and self.release is not None:
                self.release(ticket.future.result())  # placed just as its client left
            raise

    def _enqueue(self, ticket: Ticket[P]) -> None:
        if len(self) >= self.max_len:
            raise Shed("queue_full", 429, 1.0, f"router queue full ({self.max_len} requests waiting)")
        local = self.slots is None and ticket.max_queued is not None
        if local and self.queued(ticket.tenant) >= (ticket.max_queued or 0):
            raise Shed("tenant_queue_full", 429, 1.0, self._tenant_full(ticket))
        if not self.queued(ticket.tenant):
            self.vtc.lift(ticket.tenant, [t for t, q in self._queues.items() if q])
        ticket.seq = next(self._seq)
        ticket.future = asyncio.get_running_loop().create_future()
        self._queues.setdefault(ticket.tenant, deque()).append(ticket)
        self.pump()

    def _remove(self, ticket: Ticket[P]) -> None:
        q = self._queues.get(ticket.tenant)
        if q is not None and ticket in q:
            q.remove(ticket)
            self._left(ticket.tenant)

    def _left(self, tenant: str) -> None:
        if not self._queues.get(tenant):
            self._queues.pop(tenant, None)
            self.vtc.last_left = tenant

    def _dispatched(self, ticket: Ticket[P]) -> None:
        self.vtc.charge(ticket.tenant, ticket.tokens, ticket.weight)
        if self.on_dispatch is not None:
            self.on_dispatch(ticket)

    def next_ticket(self) -> Ticket[P] | None:
        # Invariant: the head of the backlogged tenant with the highest priority, then the smallest
        # virtual token counter, then the earliest arrival.
        heads = [q[0] for q in self._queues.values() if q]
        if not heads:
            return None
        return min(heads, key=lambda t: (-t.priority, self.vtc.value(t.tenant), t.seq))

    def pump(self) -> int:
        """Place waiters while engines have room; returns how many went."""
        sent = 0
        while (ticket := self.next_ticket()) is not None:
            assert ticket.future is not None
            if ticket.future.done():  # its waiter gave up between two pumps
                self._remove(ticket)
                continue
            placed = ticket.place()
            if placed is None:
                break
            self._queues[ticket.tenant].popleft()
            self._left(ticket.tenant)
            self._dispatched(ticket)
            ticket.future.set_result(placed)
            sent += 1
        return sent
