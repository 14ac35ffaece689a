"""The whole local stack as a user drives it: `kvfleet up` on the tiny model, the official openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvfleet.router.local import LOCAL_API_KEY
from kvfleet.testing.processes import free_port


@pytest.fixture(scope="module")
def fleet_url() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvfleet.cli",
            "up",
            "--replicas",
            "2",
            "--model",
            "tiny",
            "--port",
            str(port),
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_both_engines_serve(url, process)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(timeout=60) == 0, "kvfleet up did not exit cleanly on SIGTERM"
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


def _wait_until_both_engines_serve(url: str, process: subprocess.Popen[bytes]) -> None:
    headers = {"Authorization": f"Bearer {LOCAL_API_KEY}"}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
    seen: set[str] = set()
    for _ in range(600):  # bounded: at most ~120 s of polling
        assert process.poll() is None, "kvfleet up exited early"
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10)
            if r.status_code == 200:
                seen.add(r.headers["x-kvfleet-engine"])
                if len(seen) == 2:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the fleet never served from two engines (saw {sorted(seen)})")


def test_the_fleet_streams_a_chat_completion_through_the_router(fleet_url: str) -> None:
    client = openai.OpenAI(base_url=f"{fleet_url}/v1", api_key=LOCAL_API_KEY)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) > 0


def test_the_same_greedy_prompt_gives_the_same_text_on_either_engine(fleet_url: str) -> None:
    client = openai.OpenAI(base_url=f"{fleet_url}/v1", api_key=LOCAL_API_KEY)
    texts = {
        client.completions.create(model="tiny", prompt="The fleet", max_tokens=6, temperature=0)
        .choices[0]
        .text
        for _ in range(4)
    }
    assert len(texts) == 1, f"the embedded model differs between engines: {texts}"


def test_a_wrong_api_key_is_refused_with_401_and_an_openai_error(fleet_url: str) -> None:
    client = openai.OpenAI(base_url=f"{fleet_url}/v1", api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_an_unknown_model_is_a_404(fleet_url: str) -> None:
    client = openai.OpenAI(base_url=f"{fleet_url}/v1", api_key=LOCAL_API_KEY)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
