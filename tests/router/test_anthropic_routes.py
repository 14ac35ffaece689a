"""The official ``anthropic`` client through the router: its ``x-api-key`` is the tenant's key, and a
message, a streamed message and a token count are admitted, charged and accounted as a chat is."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from kvfleet.testing.processes import SimFlags, engine_process, sim_engines
from kvfleet.testing.tools import answered, tool_use

from .test_integration import KEY, in_process_router

SIM = SimFlags(max_num_seqs=8, num_kv_blocks=256, base_ms=1.0, max_model_len=2048)
HI: Any = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[list[str]]:
    with sim_engines(1, SIM) as engines:
        yield [u for u, _ in engines]


def _tokens(state: Any) -> tuple[float, float]:
    m = state.metrics
    labels = {"model": "tiny", "tenant": "alice"}
    return m.prompt_tokens.labels(**labels)._value.get(), m.generation_tokens.labels(**labels)._value.get()


async def test_a_message_and_a_streamed_one_are_accounted_with_the_usage_the_engine_reports(
    engine: list[str], tmp_path: Path
) -> None:
    log = tmp_path / "usage.jsonl"
    async with in_process_router(engine, usage_log=str(log)) as (url, state):
        client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
        msg = await client.messages.create(
            model="tiny", messages=HI, max_tokens=5, extra_body={"temperature": 0}
        )
        assert [b.type for b in msg.content] == ["text"] and msg.usage.output_tokens == 5
        assert _tokens(state) == (msg.usage.input_tokens, 5)
        async with client.messages.stream(model="tiny", messages=HI, max_tokens=4) as stream:
            kinds = [e.type async for e in stream]
            final = await stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4
        assert _tokens(state) == (2 * msg.usage.input_tokens, 9)
        counted = await client.messages.count_tokens(model="tiny", messages=HI)
        assert counted.input_tokens == msg.usage.input_tokens
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["tenant"], r["status"], r["output_tokens"]) for r in records] == [
        ("alice", 200, 5), ("alice", 200, 4), ("alice", 200, 0)
    ]  # fmt: skip
    assert [r["prompt_tokens"] for r in records] == [msg.usage.input_tokens] * 3


async def test_a_wrong_key_and_bad_input_are_anthropic_errors_that_take_no_quota(engine: list[str]) -> None:
    async with in_process_router(engine, limits={"requestsPerMinute": 1}) as (url, state):
        wrong = anthropic.AsyncAnthropic(base_url=url, api_key="sk-nobody", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as denied:
            await wrong.messages.create(model="tiny", messages=HI, max_tokens=2)
        assert denied.value.body == {
            "type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}
        }  # fmt: skip
        async with httpx.AsyncClient(base_url=url, headers={"x-api-key": KEY}) as c:
            bad = await c.post("/v1/messages", json={"model": "tiny", "messages": HI, "max_tokens": 0})
            models = await c.get("/v1/models")
        assert bad.status_code == 400
        assert bad.json()["error"] == {
            "type": "invalid_request_error", "message": "max_tokens: Input should be greater than or equal to 1 (got 0)"
        }  # fmt: skip
        assert models.status_code == 200  # x-api-key is a key on every route
        client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
        await client.messages.create(model="tiny", messages=HI, max_tokens=2)  # the one request a minute
        with pytest.raises(anthropic.RateLimitError) as limited:
            await client.messages.create(model="tiny", messages=HI, max_tokens=2)
        assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
}


async def test_a_tool_round_trip_through_the_router_on_the_real_tiny_model() -> None:
    flags = ("--model", "tiny", "--max-model-len", "2048", "--num-kv-blocks", "256", "--max-num-seqs", "2")
    with engine_process(*flags) as (engine_url, _):
        async with in_process_router([engine_url]) as (url, _state):
            client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
            tools: Any = [{"name": "get_weather", "input_schema": WEATHER}]
            ask: Any = {"model": "tiny", "max_tokens": 100, "tools": tools, "extra_body": {"temperature": 0}}
            called = await client.messages.create(
                **ask, messages=HI, tool_choice={"type": "tool", "name": "get_weather"}
            )
            history = answered(HI, called, tool_use(called, WEATHER), "Sunny")
            answer = await client.messages.create(**ask, messages=history, tool_choice={"type": "none"})
    assert called.stop_reason == "tool_use"
    assert [b.type for b in answer.content] == [
        "text"
    ] and answer.usage.input_tokens > called.usage.input_tokens


async def test_tokenize_and_detokenize_pass_through_and_are_charged_as_prompt_tokens(
    engine: list[str], tmp_path: Path
) -> None:
    log = tmp_path / "usage.jsonl"
    async with in_process_router(engine, usage_log=str(log)) as (url, state):
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as c:
            counted = await c.post("/tokenize", json={"model": "tiny", "prompt": "hello"})
            back = await c.post("/detokenize", json={"model": "tiny", "tokens": counted.json()["tokens"][1:]})
            no_model = await c.post("/tokenize", json={"prompt": "hello"})
            outside = await c.post("/detokenize", json={"model": "tiny", "tokens": [10**6]})
        assert counted.status_code == 200 and counted.json()["count"] == 6  # <s> and five bytes
        assert back.json() == {"prompt": "hello"}
        assert (no_model.status_code, no_model.json()["error"]["param"]) == (400, "model")
        assert (outside.status_code, outside.json()["error"]["param"]) == (
            400,
            "tokens.0",
        )  # the engine's 400
        assert _tokens(state) == (6 + 5, 0)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["status"], r["prompt_tokens"]) for r in records] == [(200, 6), (200, 5), (400, 0)]


async def test_an_engine_killed_mid_message_ends_the_stream_with_anthropics_error_event() -> None:
    with sim_engines(
        1, SimFlags(max_num_seqs=8, num_kv_blocks=256, base_ms=40.0, max_model_len=2048)
    ) as fleet:
        async with (
            in_process_router([u for u, _ in fleet]) as (url, state),
            httpx.AsyncClient(base_url=url, timeout=30, headers={"x-api-key": KEY}) as http,
        ):
            body = {"model": "tiny", "messages": HI, "stream": True, "max_tokens": 200}
            async with http.stream("POST", "/v1/messages", json=body) as r:
                lines = r.aiter_lines()
                assert await anext(lines) == "event: message_start"
                fleet[0].process.send_signal(signal.SIGKILL)
                rest = [line async for line in lines if line]
            assert rest[-2:] == [
                "event: error",
                'data: {"type":"error","error":{"type":"api_error",'
                '"message":"the engine stopped before the response was complete"}}',
            ]
            assert state.quota.in_flight("alice") == 0
