"""The router end to end over HTTP, in front of scripted in-test engines, driven by the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest

from kvfleet.router import pipeline
from kvfleet.router.accounting import Exchange
from kvfleet.router.app import build_app
from kvfleet.router.config import RouterConfig, TenantEntry
from kvfleet.testing.processes import free_port

from ..waiting import wait_until
from .fakes import FakeEngine, served

KEY = "sk-alice-0123456789"


def tenant(name: str = "alice", key: str = KEY, **limits: Any) -> TenantEntry:
    models = limits.pop("models", [])
    return TenantEntry.model_validate({"tenant": name, "apiKey": key, "models": models, "limits": limits})


@contextlib.asynccontextmanager
async def router(
    engines: list[FakeEngine], tenants: list[TenantEntry], **cfg: Any
) -> AsyncIterator[tuple[str, Any]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(served(e.app(), free_port())) for e in engines]
        config = RouterConfig(
            engines=urls, tenants=tenants, **{"load_interval_s": 0.05, "load_stale_s": 5.0, **cfg}
        )
        app = build_app(config)
        url = await stack.enter_async_context(served(app, free_port()))
        state = app.state.router
        await wait_until(lambda: all(e.load is not None for e in state.fleet.engines.values()), 200, 0.02)
        yield url, state


def client(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def test_a_chat_stream_passes_through_and_usage_is_accounted_from_the_final_chunk() -> None:
    engine = FakeEngine()
    async with router([engine], [tenant()]) as (url, state):
        stream = await client(url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=5
        )
        texts = [c.choices[0].delta.content async for c in stream if c.choices]
        assert texts == ["Hel", "lo", " world"]
        assert engine.received[0]["stream_options"] == {"include_usage": True}
        m = state.metrics
        assert m.prompt_tokens.labels(model="tiny", tenant="alice")._value.get() == 7
        assert m.generation_tokens.labels(model="tiny", tenant="alice")._value.get() == 3
        assert m.requests.labels(model="tiny", tenant="alice", code="200")._value.get() == 1


async def test_the_usage_chunk_reaches_a_client_that_asked_for_it() -> None:
    async with router([FakeEngine()], [tenant()]) as (url, _):
        stream = await client(url).completions.create(
            model="tiny", prompt="hi", stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 10


async def test_a_non_streaming_completion_names_its_engine_in_a_header() -> None:
    engine = FakeEngine()
    async with router([engine], [tenant()]) as (url, state):
        raw = await client(url).completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=3)
        assert raw.parse().choices[0].text == "Hello world"
        engine_url = next(iter(state.fleet.engines))
        assert raw.headers["x-kvfleet-engine"] == engine_url.removeprefix("http://")


async def test_keys_models_and_bodies_are_checked_before_any_quota_is_spent() -> None:
    async with router([FakeEngine()], [tenant(requestsPerMinute=1, models=["tiny"])]) as (url, state):
        async with httpx.AsyncClient(base_url=url) as http:
            none = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert none.status_code == 401 and none.json()["error"]["code"] == "missing_api_key"
            bad = await http.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "x"},
                headers={"Authorization": "Bearer sk-wrong-key-000"},
            )
            assert bad.status_code == 401 and "sk-wrong" not in bad.text
            auth = {"Authorization": f"Bearer {KEY}"}
            malformed = await http.post("/v1/completions", content=b"{not json", headers=auth)
            assert (
                malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
            )
            wrong_type = await http.post(
                "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": "9"}, headers=auth
            )
            assert wrong_type.status_code == 400
            assert wrong_type.json()["error"]["param"] == "max_tokens"
            assert (
                wrong_type.json()["error"]["message"]
                == "max_tokens: Input should be a valid integer (got '9')"
            )
            other = await http.post("/v1/completions", json={"model": "llama", "prompt": "x"}, headers=auth)
            assert other.status_code == 403 and other.json()["error"]["code"] == "model_not_allowed"
            ok = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth)
            assert ok.status_code == 200, "the refused requests took nothing from requestsPerMinute=1"
            over = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth)
            assert over.status_code == 429 and over.headers["retry-after"] == "60"
            assert over.json()["error"]["message"].startswith("tenant over its quota: requestsPerMinute=1")
        assert (
            state.metrics.rejections.labels(
                model="tiny", tenant="alice", reason="requests_per_minute"
            )._value.get()
            == 1
        )


async def test_an_unknown_model_is_404() -> None:
    async with router([FakeEngine()], [tenant()]) as (url, _):
        with pytest.raises(openai.NotFoundError, match="model 'nope' is not served here"):
            await client(url).completions.create(model="nope", prompt="x")


async def test_a_request_over_max_tokens_per_request_is_400_naming_the_limit() -> None:
    async with router([FakeEngine()], [tenant(maxTokensPerRequest=100)]) as (url, _):
        with pytest.raises(openai.BadRequestError, match="over the tenant's maxTokensPerRequest=100"):
            await client(url).completions.create(model="tiny", prompt="x" * 40, max_tokens=95)


async def test_two_hundred_concurrent_requests_admit_exactly_max_concurrent() -> None:
    gate = asyncio.Event()
    engine = FakeEngine(gate=gate)
    async with router([engine], [tenant(maxConcurrentRequests=10)], max_engine_queue=1000) as (url, state):
        # aiohttp: httpx's pool is quadratic in open connections, too slow for 200 at once here
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            auth = {"Authorization": f"Bearer {KEY}"}

            async def one() -> int:
                body = {"model": "tiny", "prompt": "x"}
                async with http.post(f"{url}/v1/completions", json=body, headers=auth) as r:
                    await r.read()
                    return r.status

            tasks = [asyncio.create_task(one()) for _ in range(200)]
            await wait_until(lambda: sum(t.done() for t in tasks) == 190 and engine.active == 10, 3000)
            assert engine.active == 10
            gate.set()
            codes = await asyncio.gather(*tasks)
        assert (codes.count(200), codes.count(429)) == (10, 190)
        assert engine.peak == 10
        assert state.quota.in_flight("alice") == 0


async def test_a_connection_refused_before_the_first_byte_retries_on_another_engine() -> None:
    engines = [FakeEngine(), FakeEngine()]
    async with router(engines, [tenant()], policy="round-robin", load_interval_s=30, load_stale_s=60) as (
        url,
        state,
    ):
        first = sorted(state.fleet.engines)[0]
        port = int(first.rsplit(":", 1)[1])
        await _stop_engine_at(port)  # its load is still fresh, so the picker chooses it first
        raw = await client(url).completions.with_raw_response.create(model="tiny", prompt="x")
        assert raw.headers["x-kvfleet-engine"] != first.removeprefix("http://")
        assert not state.fleet.is_ready(state.fleet.engines[first])


async def test_an_engine_that_answers_503_engine_dead_is_taken_out_and_the_request_placed_again() -> None:
    dead, alive = FakeEngine(mode="dead"), FakeEngine()
    async with router(
        [dead, alive], [tenant()], policy="round-robin", load_interval_s=30, load_stale_s=60
    ) as (
        url,
        state,
    ):
        for _ in range(3):
            assert (await client(url).completions.create(model="tiny", prompt="x")).choices[0].text
        assert (len(dead.received), len(alive.received)) == (1, 3), "once refused, out of rotation"
        assert sorted(state.fleet.is_ready(e) for e in state.fleet.engines.values()) == [False, True]
        assert state.quota.in_flight("alice") == 0


async def test_when_every_engine_answers_503_the_client_gets_503_naming_the_refusal() -> None:
    async with router([FakeEngine(mode="dead")], [tenant()]) as (url, state):
        with pytest.raises(openai.APIStatusError) as info:
            await client(url).completions.create(model="tiny", prompt="x")
        assert info.value.status_code == 503
        assert "answered 503 engine_dead" in info.value.message
        assert state.quota.in_flight("alice") == 0


async def test_an_engine_whose_load_says_not_ready_gets_no_requests() -> None:
    unready, ready = FakeEngine(load={"ready": False}), FakeEngine()
    async with router([unready, ready], [tenant()], policy="round-robin") as (url, _):
        for _ in range(4):
            await client(url).completions.create(model="tiny", prompt="x")
    assert (len(unready.received), len(ready.received)) == (0, 4)


async def _stop_engine_at(port: int) -> None:
    from .fakes import RUNNING

    server = RUNNING[port]
    server.should_exit = True
    await wait_until(lambda: not server.started or server.should_exit and not server.servers, 300)
    await asyncio.sleep(0.2)


async def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error_and_refunds_the_quota() -> None:
    dying = FakeEngine(mode="die")
    async with router([dying], [tenant(tokensPerMinute=1000, maxConcurrentRequests=1)]) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            body = {"model": "tiny", "prompt": "x", "stream": True, "max_tokens": 10}
            r = await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        events = [e for e in r.text.split("\n\n") if e]
        assert events[0].startswith("data: {") and '"text": "Hel"' in events[0]
        assert '"code": "engine_failed"' in events[-2] and events[-1] == "data: [DONE]"
        engine = next(iter(state.fleet.engines.values()))
        assert engine.in_flight == 0 and state.quota.in_flight("alice") == 0
        assert state.quota._state["alice"].tokens.level == pytest.approx(1000, abs=1)
        assert state.metrics.requests.labels(model="tiny", tenant="alice", code="502")._value.get() == 1


async def test_a_hanging_engine_times_out_with_504_and_is_taken_out() -> None:
    async with router(
        [FakeEngine(mode="hang")], [tenant()], engine_read_timeout_s=0.3, load_interval_s=30, load_stale_s=60
    ) as (url, state):
        with pytest.raises(openai.APIStatusError) as info:
            await client(url).completions.create(model="tiny", prompt="x")
        assert info.value.status_code == 504
        assert not any(state.fleet.is_ready(e) for e in state.fleet.engines.values())


async def test_a_client_that_disconnects_cancels_the_upstream_stream() -> None:
    engine = FakeEngine(tokens=["t"] * 200)
    async with router([engine], [tenant()]) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            body = {"model": "tiny", "prompt": "x", "stream": True}
            async with http.stream(
                "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as r:
                async for _ in r.aiter_bytes():
                    break
        await wait_until(lambda: engine.aborted and state.quota.in_flight("alice") == 0, 300)
        assert engine.aborted == 1 and engine.active == 0
        assert state.quota.in_flight("alice") == 0
        assert state.metrics.requests.labels(model="tiny", tenant="alice", code="499")._value.get() == 1


async def test_requests_wait_while_every_engine_is_saturated_and_shed_at_the_deadline() -> None:
    engine = FakeEngine(load={"max_num_seqs": 1})
    engine.gate = asyncio.Event()
    async with router([engine], [tenant()], max_engine_queue=0, max_queue_wait_s=0.3) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            auth = {"Authorization": f"Bearer {KEY}"}
            body = {"model": "tiny", "prompt": "x"}
            first = asyncio.create_task(http.post("/v1/completions", json=body, headers=auth))
            await wait_until(lambda: engine.active, 3000)
            shed = await http.post("/v1/completions", json=body, headers=auth)
            assert shed.status_code == 503 and shed.headers["retry-after"] == "1"
            assert shed.json()["error"]["code"] == "deadline"
            waiting = asyncio.create_task(http.post("/v1/completions", json=body, headers=auth))
            await wait_until(lambda: state.waiting("tiny"), 3000)
            assert state.waiting("tiny") == 1
            engine.gate.set()
            assert (await first).status_code == 200
            assert (await waiting).status_code == 200
        rej = state.metrics.rejections.labels(model="tiny", tenant="alice", reason="deadline")
        assert rej._value.get() == 1


async def test_no_ready_engine_is_503() -> None:
    engine = FakeEngine(load={"draining": True})
    async with router([engine], [tenant()]) as (url, _):
        for _ in range(100):
            try:
                await client(url).completions.create(model="tiny", prompt="x")
            except openai.InternalServerError as exc:
                assert exc.status_code == 503 and "no ready engine serves model 'tiny'" in str(exc)
                return
            except openai.NotFoundError:
                await asyncio.sleep(0.02)
        raise AssertionError("never 503")


async def test_the_metrics_endpoint_exports_the_design_names() -> None:
    async with router([FakeEngine()], [tenant()]) as (url, _):
        await client(url).completions.create(model="tiny", prompt="x", stream=False)
        async with httpx.AsyncClient(base_url=url) as http:
            text = (await http.get("/metrics")).text
    for name in [
        "kvfleet_router_requests_total",
        "kvfleet_router_engine_up",
        "kvfleet_router_prompt_tokens_total",
        "kvfleet_router_generation_tokens_total",
        "kvfleet_router_queue_depth",
        "kvfleet_router_rejections_total",
        "kvfleet_router_time_to_first_token_seconds",
        "kvfleet_router_queue_wait_seconds",
    ]:
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert 'kvfleet_router_requests_total{code="200",model="tiny",tenant="alice"} 1.0' in text


async def test_a_bug_while_admitting_is_a_500_error_body_counted_as_500_on_a_kept_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def broken_place(*_: Any) -> None:
        raise RuntimeError("a bug")

    async with router([FakeEngine()], [tenant()]) as (url, state):
        monkeypatch.setattr(pipeline, "place", broken_place)
        auth = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=1)) as http:
            resp = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth)
            assert resp.status_code == 500
            assert resp.json()["error"] == {
                "message": "internal error: RuntimeError",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
            first = resp.extensions["network_stream"].get_extra_info("client_addr")
            monkeypatch.undo()
            ok = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=auth)
            assert ok.status_code == 200
            assert ok.extensions["network_stream"].get_extra_info("client_addr") == first
        rejected = state.metrics.rejections.labels(model="tiny", tenant="alice", reason="internal_error")
        assert rejected._value.get() == 1
        assert state.metrics.requests.labels(model="tiny", tenant="alice", code="499")._value.get() == 0


async def test_a_bug_before_admission_is_a_500_error_body_counted_as_500(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_parse(*_: Any) -> None:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    async with router([FakeEngine()], [tenant()]) as (url, state):
        monkeypatch.setattr(pipeline, "parse_request", broken_parse)
        async with httpx.AsyncClient(base_url=url) as http:
            resp = await http.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": "x"},
                headers={"Authorization": f"Bearer {KEY}"},
            )
        assert resp.status_code == 500 and resp.headers["content-type"] == "application/json"
        assert resp.json()["error"] == {
            "message": "internal error: UnicodeEncodeError",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
        rejected = state.metrics.rejections.labels(model="unknown", tenant="unknown", reason="internal_error")
        assert rejected._value.get() == 1


async def test_a_bug_mid_stream_is_counted_as_500_not_as_a_client_that_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_event(*_: Any) -> None:
        raise RuntimeError("a bug")

    async with router([FakeEngine()], [tenant()]) as (url, state):
        monkeypatch.setattr(Exchange, "on_event", broken_event)
        body = {"model": "tiny", "prompt": "x", "stream": True}
        async with httpx.AsyncClient(base_url=url) as http:
            with pytest.raises(httpx.RemoteProtocolError):
                async with http.stream(
                    "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
                ) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
        requests = state.metrics.requests
        assert requests.labels(model="tiny", tenant="alice", code="500")._value.get() == 1
        assert requests.labels(model="tiny", tenant="alice", code="499")._value.get() == 0
