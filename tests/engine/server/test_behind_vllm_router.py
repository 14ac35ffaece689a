"""vLLM's own router (the real ``vllm-router`` binary, dev extra) in front of a kvfleet engine on ``--model tiny``.

vllm-router adds fields of its own to every body it forwards (``no_stop_trim``); the engine
ignores what it does not know, as vLLM does, so completions and chats through it, streamed
or not, are served (issue #28). Every start and wait is bounded in time.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfleet.oslib import free_port
from kvfleet.testing.processes import engine_process, stop, wait_http

pytest.importorskip("vllm_router", reason="vllm-router comes with the dev extra")
pytestmark = pytest.mark.slow

ENGINE_FLAGS = ("--model", "tiny", "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "4")
MESSAGES = [{"role": "user", "content": "Hello"}]


@contextlib.contextmanager
def vllm_router(engine_url: str) -> Iterator[str]:
    """``vllm-router`` on a free port of 127.0.0.1 in front of ``engine_url``; its base URL once healthy."""
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    port = free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", engine_url,
            "--policy", "round_robin", "--log-level", "warning", "--prometheus-port", str(free_port()),
            "--worker-startup-timeout-secs", "60", "--request-timeout-secs", "60"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc, timeout_s=60)
        yield url
    finally:
        stop([proc])


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, str]]:
    """(vllm-router's URL, the engine's URL)."""
    with engine_process(*ENGINE_FLAGS, ready_timeout_s=240) as (engine, _), vllm_router(engine) as router:
        yield router, engine


def _ignored(engine: str, field: str) -> float:
    text = httpx.get(engine + "/metrics", timeout=10).text
    m = re.search(
        rf'^kvfleet_engine_ignored_request_fields_total{{(?=[^}}]*model_name="tiny")[^}}]*field="{field}"[^}}]*}} (\S+)$',
        text,
        re.M,
    )
    return 0.0 if m is None else float(m.group(1))


def _events(sse: str) -> list[dict[str, Any]]:
    assert sse.rstrip().endswith("data: [DONE]"), sse[-200:]
    return [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]


def test_a_completion_through_vllm_router_is_served(fleet: tuple[str, str]) -> None:
    router, engine = fleet
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    direct = httpx.post(engine + "/v1/completions", json=body, timeout=60)
    resp = httpx.post(router + "/v1/completions", json=body, timeout=60)
    assert (direct.status_code, resp.status_code) == (200, 200), resp.text
    assert resp.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    assert resp.json()["usage"]["completion_tokens"] == 4
    assert _ignored(engine, "no_stop_trim") >= 1.0  # what vllm-router adds: ignored, counted


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_through_vllm_router_is_served_streamed_or_not(fleet: tuple[str, str], stream: bool) -> None:
    router, engine = fleet
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    direct = httpx.post(engine + "/v1/chat/completions", json=body, timeout=60).json()
    resp = httpx.post(router + "/v1/chat/completions", json=body | {"stream": stream}, timeout=60)
    assert resp.status_code == 200, resp.text
    want = direct["choices"][0]["message"]["content"]
    if stream:
        chunks = _events(resp.text)
        got = "".join(c["delta"].get("content") or "" for e in chunks for c in e["choices"])
    else:
        got = resp.json()["choices"][0]["message"]["content"]
    assert got == want


def test_a_streamed_completion_through_vllm_router_is_served(fleet: tuple[str, str]) -> None:
    router, engine = fleet
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    want = httpx.post(engine + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    resp = httpx.post(router + "/v1/completions", json=body | {"stream": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert "".join(c["text"] for e in _events(resp.text) for c in e["choices"]) == want
