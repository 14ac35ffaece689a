"""Bursts of long prompts through the process core: back-pressure on the core link is a wait, never a death.

Real ``kvfleet engine`` processes (simulated and on the tiny model), hit by many concurrent
requests whose prompts add up to far more than the socket buffers between the API process
and its core hold; every request must be answered and the engine must stay healthy.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections import Counter

import httpx
import pytest

from kvfleet.engine.link import frame
from kvfleet.testing.processes import engine_process

WORDS = ["alpha", "beta", "gamma", "delta", "kv", "fleet", "token", "cache", "über", "naïve"]


def _prompt(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def _socket_buffers() -> int:
    """What a socket pair's two buffers hold between them (send + receive), the most a writer can get ahead."""
    a, b = socket.socketpair()
    with a, b:
        return int(a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)) + int(
            b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        )


async def _burst(url: str, prompts: list[str], max_tokens: int) -> Counter[str]:
    async def one(i: int, prompt: str, http: httpx.AsyncClient) -> str:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": i % 2 == 0,
            "ignore_eos": True,
        }
        r = await http.post(f"{url}/v1/completions", json=body)
        if r.status_code != 200:
            return f"{r.status_code} {r.text[:120]}"
        if body["stream"]:
            return (
                "ok"
                if r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
                else r.text[-200:]
            )
        return "ok" if r.json()["usage"]["completion_tokens"] == max_tokens else r.text[:200]

    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=280, limits=limits) as http:
        results = await asyncio.gather(*(one(i, p, http) for i, p in enumerate(prompts)))
        assert (await http.get(f"{url}/health")).status_code == 200
    return Counter(results)


@pytest.mark.slow
def test_two_hundred_six_thousand_token_prompts_at_once_are_all_answered_by_the_simulated_engine() -> None:
    rng = random.Random(7)
    prompts = [_prompt(rng, rng.randint(5000, 6000)) for _ in range(200)]  # byte tokens: 1 per char or more
    assert sum(len(frame(list(p.encode()))) for p in prompts) > 4 * _socket_buffers()
    with engine_process(
        "--simulate", "--model", "tiny", "--max-model-len", "8192", "--num-kv-blocks", "4096",
        "--sim-base-ms", "1", "--sim-per-token-ms", "0.0005", ready_timeout_s=120,
    ) as (url, proc):  # fmt: skip
        assert asyncio.run(_burst(url, prompts, max_tokens=8)) == Counter({"ok": 200})
        assert proc.poll() is None
    assert proc.returncode == 0, "drained and exited cleanly"


@pytest.mark.slow
def test_a_burst_of_long_prompts_is_all_answered_by_the_tiny_model_through_its_core_process() -> None:
    rng = random.Random(11)
    prompts = [_prompt(rng, rng.randint(1500, 1900)) for _ in range(160)]  # tiny's context is 2048
    assert sum(len(frame(list(p.encode()))) for p in prompts) > _socket_buffers()
    flags = ("--model", "tiny", "--num-kv-blocks", "4096", "--max-num-batched-tokens", "4096")
    with engine_process(*flags, ready_timeout_s=120) as (url, proc):
        assert asyncio.run(_burst(url, prompts, max_tokens=3)) == Counter({"ok": 160})
        assert proc.poll() is None
    assert proc.returncode == 0, "drained and exited cleanly"
