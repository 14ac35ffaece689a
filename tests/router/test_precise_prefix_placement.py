"""The fleet's precise-prefix placement (router/fleet.py with router/kv_index.py): the engine whose KV
events say it holds the longest prefix wins, per its kind's hashes, within the default's load bound;
an engine whose events stopped while busy, or that is not followed, is scored by the router's estimate."""

from __future__ import annotations

from kvfleet.kv_events import BlockStored, KVEventBatch
from kvfleet.kv_hashing import kvfleet_block_hashes, vllm_block_hashes
from kvfleet.protocol import EngineLoad
from kvfleet.router.config import RouterConfig
from kvfleet.router.discovery import Endpoint, FleetView
from kvfleet.router.fleet import Fleet
from kvfleet.router.kv_index import KVIndex, PreciseQuery

from .conftest import FakeClock

A, B, V = "http://a", "http://b", "http://v"
TOKENS = tuple(range(1, 65))  # 4 blocks of 16


def idle(running: int = 0) -> EngineLoad:
    return EngineLoad(model="tiny", kv_cache_usage=0.1, num_waiting=0, num_running=running, max_num_seqs=8)


def fleet_of(clock: FakeClock, *endpoints: Endpoint) -> Fleet:
    fleet = Fleet(RouterConfig(policy="precise-prefix", load_stale_s=60.0, engine_silent_s=60.0), clock)
    fleet.kv_index = KVIndex(stale_after_s=30.0, clock=clock)
    fleet.apply_view(FleetView(endpoints))
    for e in endpoints:
        fleet.observe(e.url, idle())
    return fleet


def publish(fleet: Fleet, url: str, hashes: list[int], block_size: int = 16) -> None:
    assert fleet.kv_index is not None
    fleet.kv_index.apply(
        url, KVEventBatch(0.0, [BlockStored(hashes, None, [], block_size, None, "GPU", None)])
    )


def test_the_engine_holding_the_longest_prefix_is_chosen_each_by_its_own_kinds_hashes(
    clock: FakeClock,
) -> None:
    fleet = fleet_of(clock, Endpoint(A), Endpoint(B), Endpoint(V, kind="vllm"))
    publish(fleet, A, kvfleet_block_hashes(TOKENS, 16)[:1])
    publish(fleet, B, kvfleet_block_hashes(TOKENS, 16)[:2])
    publish(fleet, V, vllm_block_hashes(TOKENS, 16)[:3])
    assert fleet.wants_precise("tiny")
    placed = fleet.place("tiny", (), precise=PreciseQuery(TOKENS))
    assert placed is not None and placed.url == V
    by_url = {c.url: c.precise_prefix for c in fleet.candidates("tiny", (), precise=PreciseQuery(TOKENS))}
    assert by_url == {A: 0.25, B: 0.5, V: 0.75}


def test_another_tenants_salt_finds_nothing_and_the_choice_falls_to_load(clock: FakeClock) -> None:
    fleet = fleet_of(clock, Endpoint(A), Endpoint(B))
    publish(fleet, A, [])
    publish(fleet, B, kvfleet_block_hashes(TOKENS, 16, cache_salt="tenant-alice"))
    fleet.engines[A].in_flight = 0
    fleet.engines[B].in_flight = 1
    cands = {
        c.url: c.precise_prefix
        for c in fleet.candidates("tiny", (), precise=PreciseQuery(TOKENS, "tenant-bob"))
    }
    assert cands == {A: 0.0, B: 0.0}
    placed = fleet.place("tiny", (), precise=PreciseQuery(TOKENS, "tenant-bob"))
    assert placed is not None and placed.url == A


def test_a_busy_engine_whose_events_stopped_is_scored_by_the_routers_estimate(clock: FakeClock) -> None:
    fleet = fleet_of(clock, Endpoint(A), Endpoint(B))
    publish(fleet, A, kvfleet_block_hashes(TOKENS, 16))
    publish(fleet, B, [])
    query = PreciseQuery(TOKENS)
    assert {c.url: c.precise_prefix for c in fleet.candidates("tiny", (), precise=query)} == {A: 1.0, B: 0.0}
    clock.advance(31.0)
    fleet.observe(A, idle(running=2))  # A is serving, yet has published nothing for 31 s
    fleet.observe(B, idle())
    assert {c.url: c.precise_prefix for c in fleet.candidates("tiny", (), precise=query)} == {A: None, B: 0.0}


def test_an_engine_not_followed_and_other_policies_get_no_precise_term(clock: FakeClock) -> None:
    fleet = fleet_of(clock, Endpoint(A))
    assert [c.precise_prefix for c in fleet.candidates("tiny", (), precise=PreciseQuery(TOKENS))] == [None]
    plain = Fleet(RouterConfig(), clock)
    plain.kv_index = KVIndex()
    assert not plain.wants_precise("tiny")
