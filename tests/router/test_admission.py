"""The admission queue: priority, the Virtual Token Counter across tenants, deadlines, shedding."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.router.admission import AdmissionQueue, Shed, Ticket, VirtualTokenCounter


class Slots:
    """A model with ``free`` engine slots; placements are slot labels."""

    def __init__(self, free: int = 0) -> None:
        self.free = free

    def place(self) -> str | None:
        if self.free <= 0:
            return None
        self.free -= 1
        return "engine"


def ticket(
    slots: Slots,
    tenant: str,
    tokens: int = 100,
    priority: int = 0,
    weight: float = 1.0,
    max_queued: int | None = None,
) -> Ticket[str]:
    return Ticket(
        tenant=tenant,
        priority=priority,
        weight=weight,
        tokens=tokens,
        place=slots.place,
        max_queued=max_queued,
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_request_goes_at_once_while_an_engine_has_room() -> None:
    slots = Slots(free=1)
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=10, max_wait_s=5)
    assert await queue.admit(ticket(slots, "a")) == "engine"
    assert len(queue) == 0 and queue.vtc.value("a") == 100


async def dispatch_order(
    queue: AdmissionQueue[str], slots: Slots, tickets: list[Ticket[str]], n: int
) -> list[str]:
    order: list[str] = []
    queue.on_dispatch = lambda t: order.append(t.tenant)
    tasks = [asyncio.create_task(queue.admit(t)) for t in tickets]
    await settle()
    for _ in range(n):
        slots.free += 1
        queue.pump()
    await settle()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return order


async def test_higher_priority_goes_first_whatever_the_counters() -> None:
    slots = Slots()
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=10, max_wait_s=5)
    queue.vtc.charge("gold", 10_000, 1.0)
    tickets = [ticket(slots, "free"), ticket(slots, "free"), ticket(slots, "gold", priority=1)]
    assert await dispatch_order(queue, slots, tickets, 3) == ["gold", "free", "free"]


async def test_weights_split_the_tokens_served_two_to_one() -> None:
    slots = Slots()
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=100, max_wait_s=5)
    tickets = [ticket(slots, "a", weight=2.0) for _ in range(30)] + [ticket(slots, "b") for _ in range(30)]
    order = await dispatch_order(queue, slots, tickets, 30)
    assert order[:8] == ["a", "b", "a", "a", "b", "a", "a", "b"]
    assert (order.count("a"), order.count("b")) == (20, 10)


async def test_fair_share_counts_tokens_so_long_requests_do_not_crowd_out_short_ones() -> None:
    slots = Slots()
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=200, max_wait_s=5)
    tickets = [ticket(slots, "long", tokens=1000) for _ in range(50)]
    tickets += [ticket(slots, "short", tokens=100) for _ in range(100)]
    order = await dispatch_order(queue, slots, tickets, 44)
    assert (order.count("long"), order.count("short")) == (4, 40)
    served = {"long": 1000 * order.count("long"), "short": 100 * order.count("short")}
    assert abs(served["long"] - served["short"]) <= 1000


def test_a_tenant_joining_the_backlog_is_lifted_to_the_least_served_counter() -> None:
    vtc = VirtualTokenCounter()
    vtc.charge("a", 500, 1.0)
    vtc.charge("b", 300, 1.0)
    vtc.lift("c", ["a", "b"])
    assert vtc.value("c") == 300
    vtc.charge("d", 900, 1.0)
    vtc.lift("d", ["a", "b"])
    assert vtc.value("d") == 900, "a lift never lowers a counter"
    vtc.last_left = "a"
    vtc.lift("e", [])
    assert vtc.value("e") == 500


async def test_a_flooding_tenant_does_not_push_another_tenants_queue_wait_past_a_bound() -> None:
    slots = Slots()
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=1000, max_wait_s=60)
    dispatched: list[Ticket[str]] = []
    queue.on_dispatch = dispatched.append
    flood = [asyncio.create_task(queue.admit(ticket(slots, "flood", tokens=400))) for _ in range(300)]
    await settle()
    waits: list[int] = []
    for _ in range(20):
        joined_at = len(dispatched)
        victim = ticket(slots, "victim", tokens=100)
        task = asyncio.create_task(queue.admit(victim))
        await settle()
        while victim not in dispatched:
            slots.free += 1
            queue.pump()
        await task
        waits.append(len(dispatched) - joined_at)
        for _ in range(5):  # the flood keeps the engines busy in between
            slots.free += 1
            queue.pump()
    p99 = sorted(waits)[int(0.99 * (len(waits) - 1))]
    print(f"victim queue wait behind a 300-request flood: p99 {p99} dispatches, max {max(waits)}")
    assert p99 <= 2 and max(waits) <= 2
    for t in flood:
        t.cancel()
    await asyncio.gather(*flood, return_exceptions=True)


async def test_a_waiter_past_its_deadline_is_shed_with_503_and_leaves_the_queue() -> None:
    slots = Slots()
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=10, max_wait_s=5)
    with pytest.raises(Shed) as info:
        await queue.admit(ticket(slots, "a"), deadline_s=0.01)
    assert (info.value.reason, info.value.status) == ("deadline", 503)
    assert len(queue) == 0


async def test_a_full_queue_sheds_with_429_and_keeps_what_it_had() -> None:
    slots = Slots()
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=2, max_wait_s=5)
    waiting = [asyncio.create_task(queue.admit(ticket(slots, "a"))) for _ in range(2)]
    await settle()
    with pytest.raises(Shed) as info:
        await queue.admit(ticket(slots, "b"))
    assert (info.value.reason, info.value.status, info.value.retry_after_s) == ("queue_full", 429, 1.0)
    slots.free = 2
    assert queue.pump() == 2
    assert await asyncio.gather(*waiting) == ["engine", "engine"]


async def test_a_tenant_past_max_queued_is_shed_naming_the_limit() -> None:
    slots = Slots()
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=10, max_wait_s=5)
    first = asyncio.create_task(queue.admit(ticket(slots, "a", max_queued=1)))
    await settle()
    with pytest.raises(Shed) as info:
        await queue.admit(ticket(slots, "a", max_queued=1))
    assert info.value.reason == "tenant_queue_full"
    assert info.value.message == "tenant over its quota: maxQueuedRequests=1"
    other = asyncio.create_task(queue.admit(ticket(slots, "b", max_queued=1)))
    await settle()
    assert len(queue) == 2
    first.cancel()
    other.cancel()
    await asyncio.gather(first, other, return_exceptions=True)
    assert len(queue) == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_gets_the_slot() -> None:
    slots = Slots()
    released: list[str] = []
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=10, max_wait_s=5, release=released.append)
    gone = asyncio.create_task(queue.admit(ticket(slots, "a")))
    stays = asyncio.create_task(queue.admit(ticket(slots, "b")))
    await settle()
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    slots.free = 1
    queue.pump()
    assert await stays == "engine" and released == []
