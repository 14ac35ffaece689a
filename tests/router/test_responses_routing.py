"""The Responses API through the router, over real simulated engines: admitted and accounted as chat,
and a ``previous_response_id`` follow-up reaching the engine that stored its predecessor through either
of two router replicas."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvfleet.protocol import HEADER_ENGINE
from kvfleet.router.config import TenantEntry
from kvfleet.router.requests import CHAT, RESPONSES, parse_request
from kvfleet.testing.processes import SimFlags

from .test_integration import KEY, in_process_router

BOB = "sk-bob-9876543210"
FLEET = (
    2,
    SimFlags(max_num_seqs=8, num_kv_blocks=256, base_ms=2.0, max_model_len=2048),
)  # the conftest's fleet


def router(urls: list[str], **cfg: Any) -> contextlib.AbstractAsyncContextManager[tuple[str, Any]]:
    """The router of :mod:`test_integration` for alice, and for bob with no limits."""
    return in_process_router(urls, TenantEntry.model_validate({"tenant": "bob", "apiKey": BOB}), **cfg)


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


async def test_a_response_is_accounted_like_chat_with_its_real_usage(
    fleet: list[str], tmp_path: Path
) -> None:
    log = tmp_path / "usage.jsonl"
    async with router(fleet, usage_log=str(log)) as (url, state):
        client = _client(url)
        whole = await client.responses.create(model="tiny", input="hello there", max_output_tokens=5)
        async with client.responses.stream(model="tiny", input="hello there", max_output_tokens=7) as stream:
            kinds = [e.type async for e in stream]
            final = await stream.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert whole.usage is not None and final.usage is not None
        m = state.metrics
        assert m.generation_tokens.labels(model="tiny", tenant="alice")._value.get() == 5 + 7
        prompt = whole.usage.input_tokens + final.usage.input_tokens
        assert m.prompt_tokens.labels(model="tiny", tenant="alice")._value.get() == prompt
        assert m.requests.labels(model="tiny", tenant="alice", code="200")._value.get() == 2
        assert m.ttft.labels(model="tiny", tenant="alice")._sum.get() > 0  # the stream's first delta was seen
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["stream"], r["output_tokens"], r["status"], r["finish_reason"]) for r in records] == [
        (False, 5, 200, "incomplete"),
        (True, 7, 200, "incomplete"),
    ]


async def test_a_bad_response_request_is_refused_before_any_quota_is_spent(fleet: list[str]) -> None:
    async with (
        router(fleet, limits={"requestsPerMinute": 1}) as (url, _),
        httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as c,
    ):
        for _ in range(3):
            bad = await c.post("/v1/responses", json={"model": "tiny", "input": "x", "max_output_tokens": -1})
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "max_output_tokens"
        good = await c.post("/v1/responses", json={"model": "tiny", "input": "x", "max_output_tokens": 2})
        assert good.status_code == 200, good.text


async def test_follow_ups_through_another_router_replica_reach_the_engine_that_stored_the_first(
    fleet: list[str],
) -> None:
    async with router(fleet) as (url_a, _), router(fleet) as (url_b, _):
        a, b = _client(url_a), _client(url_b)
        firsts = []
        for i in range(6):
            raw = await a.responses.with_raw_response.create(
                model="tiny", input=f"hi {i}", max_output_tokens=2
            )
            firsts.append((raw.headers[HEADER_ENGINE], raw.parse()))
        assert len({engine for engine, _ in firsts}) == 2  # both engines stored some
        for engine, first in firsts:
            raw = await b.responses.with_raw_response.create(
                model="tiny", input="again", previous_response_id=first.id, max_output_tokens=2
            )
            follow = raw.parse()
            assert (raw.headers[HEADER_ENGINE], follow.previous_response_id) == (engine, first.id)
            got = await b.responses.with_raw_response.retrieve(follow.id)
            assert (got.headers[HEADER_ENGINE], got.parse().id) == (engine, follow.id)


async def test_a_follow_up_whose_predecessor_is_not_stored_is_a_404_naming_it(fleet: list[str]) -> None:
    async with router(fleet) as (url, _), router(fleet[:1]) as (url_one, _):
        client, one = _client(url), _client(url_one)
        unknown = "resp_" + "0" * 32 + "_00000000"  # an engine tag no engine has
        for missing in ("resp_nothing", unknown):
            with pytest.raises(openai.NotFoundError) as caught:
                await client.responses.create(
                    model="tiny", input="x", previous_response_id=missing, max_output_tokens=2
                )
            assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unknown)
        # A response stored on the engine a router does not have (it left its fleet): a 404, not a new chat.
        other = fleet[1].split("//", 1)[1]
        for _ in range(20):
            raw = await client.responses.with_raw_response.create(
                model="tiny", input="hi", max_output_tokens=2
            )
            if raw.headers[HEADER_ENGINE] == other:
                break
        assert raw.headers[HEADER_ENGINE] == other
        with pytest.raises(openai.NotFoundError) as caught:
            await one.responses.create(model="tiny", input="x", previous_response_id=raw.parse().id)
        assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_another_tenant_cannot_continue_a_stored_response(fleet: list[str]) -> None:
    async with router(fleet) as (url, _):
        alice = _client(url)
        bob = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=BOB, max_retries=0)
        first = await alice.responses.create(model="tiny", input="a secret", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError) as caught:
            await bob.responses.create(
                model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2
            )
        assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
        follow = await alice.responses.create(
            model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2
        )
        assert follow.previous_response_id == first.id


def test_a_response_request_is_estimated_and_limited_as_the_chat_it_amounts_to() -> None:
    items = [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f",
             "arguments": "{}"}, {"type": "function_call_output", "call_id": "c1", "output": "42"}]  # fmt: skip
    resp = parse_request(RESPONSES, json.dumps({"model": "tiny", "input": items, "instructions": "be brief",
                                                "max_output_tokens": 9}).encode(), 100)  # fmt: skip
    chat = parse_request(CHAT, json.dumps({"model": "tiny", "max_tokens": 9, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]}).encode(), 100)  # fmt: skip
    assert (resp.prompt, resp.max_tokens) == (chat.prompt, chat.max_tokens)
    assert resp.prompt_tokens_estimate(4.0) == chat.prompt_tokens_estimate(4.0)
    assert parse_request(RESPONSES, b'{"model": "tiny", "input": "x"}', 100).max_tokens == 100  # the default
    streamed = parse_request(RESPONSES, b'{"model": "tiny", "input": "x", "stream": true}', 100)
    assert "stream_options" not in streamed.upstream_body()  # a Responses stream reports its usage itself
