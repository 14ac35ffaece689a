"""precise-prefix through the real router over two tiny kvfleet engines: each engine publishes its KV
events (--kv-events-config), the router follows them (--kv-events) and sends a prompt to the engine
that holds its prefix, even where the router itself never sent that prompt anywhere."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from kvfleet.oslib import free_port
from kvfleet.protocol import HEADER_ENGINE
from kvfleet.testing.processes import engine_process, routers, tenants_file

pytestmark = pytest.mark.timeout(600)
KEY = "sk-precise-0123456789"
PROMPTS = {  # ~20 blocks of 16 bytes each (the tiny model's tokenizer is byte-level)
    "a": "Ships leave the harbour at dawn, loaded with containers of every colour. " * 4,
    "b": "The lighthouse keeper counts the boats that come home before the storm. " * 4,
    "c": "A cartographer redraws the coastline every spring after the ice retreats. " * 4,
    "d": "Fishermen mend their nets on the pier while gulls argue over the catch. " * 4,
}


def events_flag(port: int) -> str:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{port + 1}",
    }
    return json.dumps(config)


def complete(url: str, prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=60.0)
    assert answer.status_code == 200, answer.text
    return answer


def wait_for_index(router: str, blocks: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in httpx.get(f"{router}/metrics").text.splitlines():
            if line.startswith("kvfleet_router_kv_index_blocks ") and float(line.split()[1]) >= blocks:
                return
        time.sleep(0.2)
    raise AssertionError(f"the router's KV index did not reach {blocks} blocks")


def test_the_router_sends_each_prompt_to_the_engine_whose_events_say_it_holds_the_prefix(
    tmp_path: Path,
) -> None:
    ports = [free_port(), free_port()]
    flags = ("--model", "tiny", "--max-num-seqs", "4")
    with (  # one engine core in its own process (the default), one in a thread of the server
        engine_process(*flags, "--kv-events-config", events_flag(ports[0]), ready_timeout_s=240) as (one, _),
        engine_process(
            *flags,
            "--engine-core",
            "thread",
            "--kv-events-config",
            events_flag(ports[1]),
            ready_timeout_s=240,
        ) as (two, _),
    ):
        sources = [
            f"{url}=tcp://127.0.0.1:{p},tcp://127.0.0.1:{p + 1}"
            for url, p in ((one, ports[0]), (two, ports[1]))
        ]
        extra = [
            "--policy",
            "precise-prefix",
            "--shared-prefix-cache",
            *(a for s in sources for a in ("--kv-events", s)),
        ]
        # behind the router's back, each prompt is computed on its home engine
        home = {"a": two, "b": one, "c": one, "d": two}  # four prompts: a guess is right 1 time in 16
        for name, engine in home.items():
            complete(engine, PROMPTS[name])
        with routers(1, [one, two], tenants_file(tmp_path / "t.yaml", [("t", KEY)]), extra) as started:
            router = started[0].url
            auth = {"Authorization": f"Bearer {KEY}"}
            wait_for_index(
                router, blocks=4 * 18
            )  # it replays what the engines published before it subscribed
            chosen: dict[str, list[str]] = {}
            for name in ("a", "b", "c", "d", "a", "b", "c", "d"):
                chosen.setdefault(name, []).append(
                    complete(router, PROMPTS[name], auth).headers[HEADER_ENGINE]
                )
            metrics = httpx.get(f"{router}/metrics").text
    assert chosen == {name: [engine.removeprefix("http://")] * 2 for name, engine in home.items()}
    assert "kvfleet_router_kv_index_blocks" in metrics
