"""KV events from the engine on the tiny model, read as any vLLM consumer reads them: a plain ZMQ SUB
socket and msgspec's decoder, and the replay socket answering a subscriber that missed batches."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.kv.block_hash import hash_block
from kvfleet.engine.kv_events import attach
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.testing.tiny import ensure_tiny_model
from kvfleet.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    parse_kv_events_config,
)

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("kvfleet-cache"))


def engine_with_events(tiny: Path, topic: str = "kv") -> tuple[Engine, zmq.Socket, zmq.Socket, str]:
    """The engine (6 blocks of 4 tokens) publishing to a bound PUB and replay socket; a SUB reading it."""
    engine = Engine(EngineConfig(model=str(tiny), block_size=4, num_kv_blocks=6, max_model_len=32))
    config = parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", '
        f'"topic": "{topic}"}}'
    )
    collector = attach(engine, config)
    assert collector is not None
    publisher = collector.publisher
    port = publisher.endpoint.rsplit(":", 1)[1]  # type: ignore[attr-defined]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(f"tcp://127.0.0.1:{port}")
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(publisher.replay_endpoint.replace("0.0.0.0", "127.0.0.1"))  # type: ignore[attr-defined]
    time.sleep(0.3)  # ZMQ's slow joiner: a SUB misses what is sent before its subscription arrives
    return engine, sub, replay, topic


def run(engine: Engine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, prompt, ONE)
    while engine.has_unfinished_requests():
        engine.step()


def received(sub: zmq.Socket, n: int) -> list[tuple[bytes, int, KVEventBatch]]:
    out = []
    for _ in range(n):
        assert sub.poll(5000), f"only {len(out)} of {n} batches arrived"
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload, type=KVEventBatch)))
    assert not sub.poll(200), "more batches than the script makes"
    return out


def chain(tokens: list[int]) -> list[int]:
    parent, out = None, []
    for i in range(0, len(tokens) - 3, 4):
        parent = hash_block(parent, tokens[i : i + 4])
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def test_a_scripted_run_publishes_store_then_nothing_on_a_hit_then_evict_and_store_then_clear(
    tiny: Path,
) -> None:
    engine, sub, _replay, _topic = engine_with_events(tiny)
    a = list(range(10, 19))  # 9 tokens: 2 full blocks cached
    c = list(range(100, 117))  # 17 tokens: needs 5 of the 6 blocks, evicting one of a's
    run(engine, "a", a)
    run(engine, "b", a)  # a hit on both blocks: the cache does not change
    run(engine, "c", c)
    assert engine.kv.pool.reset_prefix_cache()
    engine.step()  # an idle step flushes the clear
    batches = received(sub, 3)
    assert [(t, s) for t, s, _b in batches] == [(b"kv", 0), (b"kv", 1), (b"kv", 2)]
    ha, hc = chain(a), chain(c)
    assert batches[0][2].events == [BlockStored(ha, None, a[:8], 4, None, "GPU", None)]
    # freed last block first: a's second block is the oldest cached free block when c allocates
    assert batches[1][2].events == [
        BlockRemoved([ha[1]], "GPU"),
        BlockStored(hc, None, c[:16], 4, None, "GPU", None),
    ]
    assert batches[2][2].events == [AllBlocksCleared()]
    assert all(b.data_parallel_rank == 0 for _t, _s, b in batches)


def test_salted_and_adapter_blocks_publish_their_extra_keys_first_block_only_for_the_salt(tiny: Path) -> None:
    engine, sub, _replay, _topic = engine_with_events(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, cache_salt="tenant-x")
    engine.add_request("s", list(range(30, 39)), params)
    while engine.has_unfinished_requests():
        engine.step()
    ((_t, _s, batch),) = received(sub, 1)
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == [("tenant-x",), None]
    assert stored.lora_name is None


def test_a_subscriber_that_missed_batches_gets_them_again_from_the_replay_socket(tiny: Path) -> None:
    engine, sub, replay, topic = engine_with_events(tiny)
    for i in range(3):
        run(engine, f"r{i}", list(range(40 + 20 * i, 49 + 20 * i)))
    live = received(sub, 3)
    replay.send_multipart((b"", (1).to_bytes(8, "big")))
    frames = []
    while True:
        assert replay.poll(5000), "the replay socket did not answer"
        frames.append(replay.recv_multipart())
        if frames[-1][2] == END_SEQ:
            break
    assert frames[-1] == [b"", b"", END_SEQ, b""]
    resent = [
        (f[1], int.from_bytes(f[2], "big"), msgspec.msgpack.decode(f[3], type=KVEventBatch))
        for f in frames[:-1]
    ]
    assert resent == [(topic.encode(), s, b) for _t, s, b in live[1:]]


def test_a_bad_kv_events_config_names_its_field() -> None:
    with pytest.raises(ValueError, match="buffer_steps"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "buffer_steps": 0}')
    with pytest.raises(ValueError, match="publiser"):
        parse_kv_events_config('{"publiser": "zmq"}')
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').publishes
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').endpoint == "tcp://*:5557"


def test_the_engine_flag_reads_vllms_json_and_refuses_a_bad_field_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from kvfleet.engine import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv"}'])
    assert args.kv_events_config.publishes and args.kv_events_config.topic == "kv"
    assert parser.parse_args([]).kv_events_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-events-config", '{"hwm": -1}'])
    assert "hwm" in capsys.readouterr().err
