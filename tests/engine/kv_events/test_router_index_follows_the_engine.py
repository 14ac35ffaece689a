"""The router's KV index (router/kv_index.py) fed over ZMQ by a real engine equals that engine's prefix
cache (the engine core over conftest's fake runner: 1,000 requests in seconds), and a batch the
subscriber missed comes back from the replay socket."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from kvfleet.engine.core.engine import Engine
from kvfleet.engine.kv_events import attach
from kvfleet.engine.kv_events.publisher import ZmqEventPublisher
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.kv_events import BlockStored, KVEventBatch, external_hash, parse_kv_events_config
from kvfleet.kv_hashing import kvfleet_block_hashes
from kvfleet.router.kv_events_sub import EventSource, KVEventSubscriber
from kvfleet.router.kv_index import KVIndex

URL = "http://engine-a:8000"
EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'


def local(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def wait_until(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the index did not catch up"
        time.sleep(0.05)


def test_the_index_equals_the_engines_cache_after_1000_random_requests_with_evictions(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(num_kv_blocks=40, block_size=4, max_model_len=64)  # the real core, a fake model
    collector = attach(engine, parse_kv_events_config(EVENTS))
    assert collector is not None
    pub = collector.publisher
    assert isinstance(pub, ZmqEventPublisher)
    index = KVIndex()
    sub = KVEventSubscriber(index)
    sub.set_sources([EventSource(URL, local(pub.endpoint), local(pub.replay_endpoint or ""))])
    sub.start()
    try:
        rng = random.Random(48)
        stems = [[rng.randrange(256) for _ in range(rng.choice((4, 8, 12)))] for _ in range(12)]
        for burst in range(100):  # 10 requests at a time: shared stems hit, the small pool evicts
            for i in range(10):
                prompt = rng.choice(stems) + [rng.randrange(256) for _ in range(rng.randrange(1, 14))]
                salt = rng.choice((None, None, "tenant-a", "tenant-b"))
                params = SamplingParams(
                    temperature=0.0, max_tokens=rng.randrange(1, 4), ignore_eos=True, cache_salt=salt
                )
                engine.add_request(f"r{burst}-{i}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
        wait_until(lambda: index.feed(URL).next_seq == pub._next_seq and pub._queue.empty())
        held = {external_hash(h) for h, group in engine.kv.pool._cached if group == 0}  # group 0 publishes
        assert set(index.blocks_of(URL)) == held
        assert index.removed > 100  # the small pool evicted many blocks on the way
        assert index.lost == 0
    finally:
        sub.stop()
        pub.shutdown()


def test_a_dropped_batch_is_recovered_from_the_replay_socket() -> None:
    pub = ZmqEventPublisher(parse_kv_events_config(EVENTS))
    index = KVIndex()
    sub = KVEventSubscriber(index)
    source = EventSource(URL, local(pub.endpoint), local(pub.replay_endpoint or ""))
    import zmq

    live = zmq.Context.instance().socket(zmq.SUB)
    live.setsockopt_string(zmq.SUBSCRIBE, "")
    live.connect(source.endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner
    chains = [kvfleet_block_hashes(list(range(8 * i, 8 * i + 8)), 4) for i in range(4)]
    for i, hashes in enumerate(chains):
        pub.publish(
            KVEventBatch(
                ts=float(i), events=[BlockStored(hashes, None, list(range(8)), 4, None, "GPU", None)]
            )
        )
    frames = []
    for _ in range(4):
        assert live.poll(5000)
        frames.append(live.recv_multipart())
    for _topic, seq, payload in frames:
        if int.from_bytes(seq, "big") != 2:  # the network lost batch 2
            sub.handle(source, int.from_bytes(seq, "big"), payload)
    assert index.replays == 1 and index.lost == 0
    assert set(index.blocks_of(URL)) == {h for hashes in chains for h in hashes}
    assert index.feed(URL).next_seq == 4
    live.close(linger=0)
    pub.shutdown()


def test_a_gap_the_replay_buffer_no_longer_holds_forgets_the_engine_instead_of_trusting_it() -> None:
    pub = ZmqEventPublisher(parse_kv_events_config(EVENTS.replace("}", ', "buffer_steps": 1}')))
    index = KVIndex()
    sub = KVEventSubscriber(index, replay_timeout_s=1.0)
    source = EventSource(URL, local(pub.endpoint), local(pub.replay_endpoint or ""))
    first = kvfleet_block_hashes(list(range(8)), 4)
    from kvfleet.kv_events import encode_batch

    sub.handle(
        source,
        0,
        encode_batch(KVEventBatch(0.0, [BlockStored(first, None, list(range(8)), 4, None, "GPU", None)])),
    )
    for i in range(3):  # batches 0..2 from the publisher; its buffer keeps only the last
        pub.publish(KVEventBatch(ts=float(i), events=[]))
    time.sleep(0.3)
    later = kvfleet_block_hashes(list(range(100, 104)), 4)
    sub.handle(
        source,
        3,
        encode_batch(
            KVEventBatch(3.0, [BlockStored(later, None, list(range(100, 104)), 4, None, "GPU", None)])
        ),
    )
    assert index.lost == 1
    assert set(index.blocks_of(URL)) == set(later)  # the first blocks may have been removed meanwhile
    pub.shutdown()
