"""The fleet's readiness rules: a loaded engine is not an unready one; a stale load is not trusted."""

from __future__ import annotations

import asyncio

import httpx

from kvfleet.protocol import EngineLoad
from kvfleet.router.config import RouterConfig
from kvfleet.router.discovery import Endpoint, FleetView, StaticDiscovery
from kvfleet.router.fleet import Fleet, PollMiss, fetch_load, first_poll_done, poll_once
from kvfleet.testing.processes import free_port

from .conftest import FakeClock
from .fakes import FakeEngine, served

A, B = "http://a", "http://b"


def busy_load(running: int = 6, waiting: int = 3) -> EngineLoad:
    return EngineLoad(
        model="tiny", kv_cache_usage=0.5, num_waiting=waiting, num_running=running, max_num_seqs=8
    )


def fleet_of(clock: FakeClock, *urls: str) -> Fleet:
    fleet = Fleet(RouterConfig(load_stale_s=3.0, engine_silent_s=10.0), clock)
    fleet.apply_view(FleetView(tuple(Endpoint(u) for u in urls)))
    for url in urls:
        fleet.observe(url, busy_load())
    return fleet


def test_a_poll_that_times_out_leaves_the_engine_ready(clock: FakeClock) -> None:
    fleet = fleet_of(clock, A)
    clock.advance(2.0)
    fleet.observe(A, PollMiss.SLOW)
    assert fleet.is_ready(fleet.engines[A])
    assert [e.url for e in fleet.ready_engines("tiny")] == [A]


def test_a_load_past_the_stale_age_gives_its_counts_over_to_the_router_in_flight(clock: FakeClock) -> None:
    fleet = fleet_of(clock, A)
    fleet.engines[A].in_flight = 2
    [fresh] = fleet.candidates("tiny", ())
    assert (fresh.load.num_running, fresh.load.num_waiting, fresh.busy) == (6, 3, 9)
    clock.advance(3.5)
    [stale] = fleet.candidates("tiny", ())
    assert (stale.load.num_running, stale.load.num_waiting, stale.busy) == (0, 0, 2)
    assert stale.load.kv_cache_usage == 0.5


def test_an_engine_silent_past_the_limit_is_unready_and_a_proxied_answer_counts_as_heard(
    clock: FakeClock,
) -> None:
    fleet = fleet_of(clock, A, B)
    clock.advance(8.0)
    fleet.heard(A)
    clock.advance(3.0)  # 11 s since either load, 3 s since A answered a request
    assert [e.url for e in fleet.ready_engines("tiny")] == [A]


def test_a_refused_or_bad_poll_takes_the_engine_out_until_the_next_good_load(clock: FakeClock) -> None:
    fleet = fleet_of(clock, A, B)
    clock.advance(0.2)
    fleet.observe(A, PollMiss.DOWN)
    fleet.observe(B, PollMiss.BAD)
    assert fleet.ready_engines("tiny") == []
    clock.advance(0.2)
    fleet.observe(A, busy_load())
    assert [e.url for e in fleet.ready_engines("tiny")] == [A]


async def test_fetch_load_tells_a_slow_engine_from_a_gone_one() -> None:
    slow = FakeEngine(load_delay_s=0.5)
    async with served(slow.app(), free_port()) as url, httpx.AsyncClient() as client:
        assert await fetch_load(client, url, timeout=0.1) is PollMiss.SLOW
        got = await fetch_load(client, url, timeout=5.0)
        assert isinstance(got, EngineLoad) and got.max_num_seqs == 256
        assert await fetch_load(client, f"http://127.0.0.1:{free_port()}", timeout=1.0) is PollMiss.DOWN
        assert await fetch_load(client, url + "/nothing", timeout=1.0) is PollMiss.BAD


def test_an_engines_backlog_is_its_uncached_prompt_tokens_less_what_the_prefill_rate_has_done(
    clock: FakeClock,
) -> None:
    fleet = fleet_of(clock, A)  # the prior: 100 tokens/s
    first = fleet.place("tiny", (1, 2, 3, 4), tokens=500, prompt_tokens=400)
    repeat = fleet.place("tiny", (1, 2, 3, 9), tokens=500, prompt_tokens=400)  # 3 of 4 blocks sent already
    assert first is not None and repeat is not None
    assert [p.tokens for p in fleet.engines[A].prefilling.values()] == [400, 100]
    assert fleet.backlog(fleet.engines[A]) == 500
    clock.advance(1.0)  # 400 - 100 and 100 - 100
    [cand] = fleet.candidates("tiny", (5,))
    assert cand.prefill_tokens == 300


def test_a_first_byte_ends_a_prefill_and_measures_the_rate_replacing_the_prior_then_averaging(
    clock: FakeClock,
) -> None:
    fleet = fleet_of(clock, A)
    first = fleet.place("tiny", (1, 2, 3, 4), prompt_tokens=400)
    repeat = fleet.place("tiny", (1, 2, 3, 9), prompt_tokens=200)  # 50 uncached tokens
    assert first is not None and repeat is not None
    clock.advance(2.0)
    fleet.prefilled(first)  # 400 tokens in 2 s
    fleet.prefilled(first)
    assert (fleet.prefill_rate, list(fleet.engines[A].prefilling)) == (200.0, [repeat.ticket])
    third = fleet.place("tiny", (7, 8), prompt_tokens=100)
    assert third is not None
    clock.advance(0.25)
    fleet.prefilled(third)  # 400 tokens/s, weighted 0.2
    fleet.prefilled(repeat)  # 50 tokens: too few to say anything about the rate
    assert fleet.prefill_rate == 240.0
    for placement in (first, repeat, third):
        fleet.release(placement)
    assert (fleet.engines[A].prefilling, fleet.engines[A].in_flight) == ({}, 0)


def test_a_request_released_before_its_first_byte_leaves_no_backlog(clock: FakeClock) -> None:
    fleet = fleet_of(clock, A)
    placed = fleet.place("tiny", (1, 2), prompt_tokens=400)
    assert placed is not None
    fleet.release(placed)
    assert (fleet.backlog(fleet.engines[A]), fleet.prefill_rate) == (0, 100.0)


async def test_a_router_just_started_waits_for_its_first_poll_before_it_says_a_model_is_unknown(
    clock: FakeClock,
) -> None:
    fleet = fleet_of(clock)
    fleet.first_poll = asyncio.Event()
    waiter = asyncio.create_task(first_poll_done(fleet))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # no round yet: the models are not known, a 404 would be false
    async with httpx.AsyncClient() as client:
        await poll_once(fleet, StaticDiscovery([]), client)
    await asyncio.wait_for(waiter, 1.0)
    assert fleet.first_poll.is_set()
    await asyncio.wait_for(first_poll_done(fleet), 0.01)  # later requests do not wait


async def test_without_a_poller_nothing_waits_for_a_first_poll(clock: FakeClock) -> None:
    await asyncio.wait_for(first_poll_done(fleet_of(clock)), 0.01)
