"""Client → the real Envoy → (ext_proc: the router) → engine, end to end on 127.0.0.1.

The router is the real one (:func:`build_app` with the gateway attached, as
``kvfleet router --envoy-xds-port`` runs it); the client is the official ``openai``
client; the engines are the router's scripted in-test engines, which record what
reached them: that is the evidence of where Envoy sent each request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio

from kvfleet.protocol import EngineLoad
from kvfleet.router.fleet import Placement
from kvfleet.router.gateway import server, xds
from kvfleet.router.gateway.router_gate import RouterGate, fallbacks
from kvfleet.router.gateway_config import GatewayConfig
from kvfleet.router.prefix import tenant_cache_salt
from kvfleet.router.usage import UsageLog

from ...waiting import wait_until
from ..fakes import FakeEngine
from .stack import ALPHA, BETA, Stack, gateway, tenant

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(free_port_module: Callable[[], int]) -> AsyncIterator[Stack]:
    tenants = [tenant("alpha", ALPHA), tenant("beta", BETA, requestsPerMinute=1)]
    async with gateway(free_port_module, [FakeEngine(), FakeEngine()], tenants) as s:
        yield s


async def test_envoy_acknowledges_the_routers_listeners_and_clusters(stack: Stack) -> None:
    want = xds_version(stack.envoy.config, {"tiny": sorted(stack.engines)})
    async with httpx.AsyncClient() as http:
        for _ in range(100):  # the fleet's last push may still be on its way: 5 s at most
            dump = (await http.get(stack.envoy.admin_url + "/config_dump")).json()
            dynamic = {c["@type"].rsplit(".", 1)[1]: c for c in dump["configs"]}
            active = dynamic["ClustersConfigDump"]["dynamic_active_clusters"]
            # Envoy stamps a cluster with the version that last changed it: the ext_proc cluster
            # keeps the first snapshot's version; the engines' cluster carries the whole fleet's.
            versions = {c["cluster"]["name"]: c["version_info"] for c in active}
            if versions.get("kvfleet_engines/tiny") == want:
                break
            await asyncio.sleep(0.05)
    listeners = [lst["name"] for lst in dynamic["ListenersConfigDump"]["dynamic_listeners"]]
    assert sorted(versions) == ["kvfleet_engines/tiny", "kvfleet_ext_proc"]
    assert listeners == ["kvfleet_gateway"]
    assert versions["kvfleet_engines/tiny"] == want


def xds_version(config: GatewayConfig, fleet: dict[str, list[str]]) -> str:
    from kvfleet.router.gateway.ads import AdsServer

    return AdsServer(xds.resources(config, fleet)).version


async def test_the_gate_offers_envoy_the_ready_engines_and_names_the_others_as_fallbacks(
    stack: Stack,
) -> None:
    gate = RouterGate(stack.state, num_retries=2)
    assert gate.endpoints() == {"tiny": sorted(stack.engines)}
    first, second = sorted(stack.engines)
    chosen = Placement(url=f"http://{first}", model="tiny", score=0.0)
    assert fallbacks(stack.state, chosen, 2) == (second,)
    assert fallbacks(stack.state, chosen, 0) == ()


async def test_a_completion_reaches_the_engine_the_router_chose_and_is_accounted(stack: Stack) -> None:
    before = stack.received()
    raw = await stack.client().completions.with_raw_response.create(
        model="tiny", prompt="hello", max_tokens=5
    )
    completion = raw.parse()
    chosen = raw.headers["x-kvfleet-engine"]
    after = stack.received()
    assert {at: after[at] - before[at] for at in after} == {at: int(at == chosen) for at in after}
    assert completion.choices[0].text == "Hello world"
    salt = tenant_cache_salt("alpha", None)  # Envoy carries the router's body: salted with the tenant
    sent = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "cache_salt": salt}
    assert stack.engines[chosen].received[-1] == sent
    assert stack.state.quota.in_flight("alpha") == 0
    assert all(e.in_flight == 0 for e in stack.state.fleet.engines.values())


async def test_a_client_cache_salt_is_kept_within_the_tenants_salt_through_envoy(stack: Stack) -> None:
    raw = await stack.client().completions.with_raw_response.create(
        model="tiny", prompt="hello", max_tokens=5, extra_body={"cache_salt": "beta"}
    )
    received = stack.engines[raw.headers["x-kvfleet-engine"]].received[-1]
    assert received["cache_salt"] == tenant_cache_salt("alpha", "beta")
    assert received["cache_salt"] not in (tenant_cache_salt("beta", None), tenant_cache_salt("alpha", None))


async def test_a_chat_stream_passes_through_event_by_event_with_usage_taken_from_the_engine(
    stack: Stack,
) -> None:
    generated = stack.state.metrics.generation_tokens.labels(model="tiny", tenant="alpha")._value.get()
    chunks = await stack.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    deltas = [c.choices[0].delta.content async for c in chunks]
    assert deltas == ["Hel", "lo", " world"]  # the usage chunk the router asked for is not the client's
    engine = next(e for e in stack.engines.values() if e.received and "messages" in e.received[-1])
    assert engine.received[-1]["stream_options"] == {"include_usage": True}
    assert (
        stack.state.metrics.generation_tokens.labels(model="tiny", tenant="alpha")._value.get()
        == generated + 3
    )


async def test_a_request_through_envoy_leaves_one_usage_record(stack: Stack, tmp_path: Path) -> None:
    stack.state.usage_log = UsageLog(str(tmp_path / "usage.jsonl"))
    answered = stack.counted("alpha", "200")
    try:
        chunks = await stack.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert [c async for c in chunks]
        # ext_proc settles once Envoy reports the end of the response
        await wait_until(lambda: stack.counted("alpha", "200") > answered, 250, 0.02)
    finally:
        stack.state.usage_log.close()
        stack.state.usage_log = None
    (record,) = [json.loads(line) for line in (tmp_path / "usage.jsonl").read_text().splitlines()]
    assert record["tenant"] == "alpha" and record["status"] == 200 and record["output_tokens"] == 3
    assert record["engine"] in stack.engines and record["stream"] is True


async def test_a_tool_call_request_passes_through_envoy_whole_and_is_accounted(stack: Stack) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
    ]  # fmt: skip
    generated = stack.state.metrics.generation_tokens.labels(model="tiny", tenant="alpha")._value.get()
    raw = await stack.client().chat.completions.with_raw_response.create(
        model="tiny", messages=history, tools=tools, tool_choice="required", parallel_tool_calls=False
    )
    received = stack.engines[raw.headers["x-kvfleet-engine"]].received[-1]
    assert (received["messages"], received["tools"]) == (history, tools)
    assert (received["tool_choice"], received["parallel_tool_calls"]) == ("required", False)
    assert (
        stack.state.metrics.generation_tokens.labels(model="tiny", tenant="alpha")._value.get()
        == generated + 3
    )
    assert stack.state.quota.in_flight("alpha") == 0


async def test_a_client_that_asks_for_usage_gets_the_engines_usage_chunk(stack: Stack) -> None:
    chunks = await stack.client().completions.create(
        model="tiny", prompt="x", stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage async for c in chunks if c.usage is not None]
    assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [(7, 3)]


async def test_a_bad_key_is_answered_401_by_envoy_and_reaches_no_engine(stack: Stack) -> None:
    before = stack.received()
    with pytest.raises(openai.AuthenticationError) as info:
        await stack.client("sk-not-a-tenant-000").completions.create(model="tiny", prompt="x")
    assert info.value.body == {
        "message": "invalid API key",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert stack.received() == before


async def test_an_x_api_key_is_the_tenants_key_through_envoy_and_stays_at_the_gateway(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.envoy.url, timeout=10) as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
            headers={"x-api-key": ALPHA},
        )
    assert r.status_code == 200, r.text
    headers = stack.engines[r.headers["x-kvfleet-engine"]].received_headers[-1]
    assert "x-api-key" not in headers and "authorization" not in headers


async def test_the_anthropic_client_through_envoy_is_admitted_and_accounted_like_chat(stack: Stack) -> None:
    m = stack.state.metrics
    generated = m.generation_tokens.labels(model="tiny", tenant="alpha")._value.get()
    client = anthropic.AsyncAnthropic(base_url=stack.envoy.url, api_key=ALPHA, max_retries=0)
    msg = await client.messages.create(
        model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    )
    async with client.messages.stream(
        model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    ) as s:
        text = "".join([t async for t in s.text_stream])
    assert [b.text for b in msg.content if b.type == "text"] == [text] == ["Hello world"]
    assert m.generation_tokens.labels(model="tiny", tenant="alpha")._value.get() == generated + 6
    assert stack.state.quota.in_flight("alpha") == 0
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error",
                  "message": "max_tokens: Input should be greater than or equal to 1 (got 0)"},
    }  # fmt: skip


async def test_bad_input_is_refused_naming_the_field_before_the_tenants_one_request_is_spent(
    stack: Stack,
) -> None:
    before = stack.received()
    async with httpx.AsyncClient(base_url=stack.envoy.url) as http:
        auth = {"authorization": f"Bearer {BETA}"}
        bad = await http.post(
            "/v1/completions", json={"model": "tiny", "max_tokens": 0, "prompt": "x"}, headers=auth
        )
        unknown = await http.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers=auth)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "max_tokens"
    assert "max_tokens" in bad.json()["error"]["message"]
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")
    assert stack.received() == before
    ok = await stack.client(BETA).completions.create(
        model="tiny", prompt="x"
    )  # requestsPerMinute=1 still whole
    assert ok.choices[0].text == "Hello world"


async def test_a_tenant_over_its_limit_gets_429_with_retry_after_and_no_engine_work(stack: Stack) -> None:
    with contextlib.suppress(openai.RateLimitError):
        await stack.client(BETA).completions.create(
            model="tiny", prompt="x"
        )  # spends the minute's one request
    before = stack.received()
    with pytest.raises(openai.RateLimitError) as info:
        await stack.client(BETA).completions.create(model="tiny", prompt="x")
    response = info.value.response
    assert response.status_code == 429
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert info.value.body["code"] == "requests_per_minute"
    assert "requestsPerMinute=1" in info.value.body["message"]
    assert stack.received() == before
    assert stack.state.quota.in_flight("beta") == 0


async def test_an_unreachable_engine_is_a_503_openai_error_refunded_and_taken_out(
    free_port: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No periodic sync: the engine's model is new to Envoy, so the request itself must get
    # its cluster pushed and acknowledged before ext_proc routes it.
    monkeypatch.setattr(server, "SYNC_INTERVAL_S", 3600.0)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tenants = [tenant("alpha", ALPHA, tokensPerMinute=1000)]
    async with gateway(free_port, [], tenants, dead=(dead,), load_interval_s=30) as s:
        # The router's last word on the engine is a good load: it died since.
        s.state.fleet.observe(
            dead, EngineLoad(model="tiny", kv_cache_usage=0.0, num_waiting=0, num_running=0, max_num_seqs=8)
        )
        with pytest.raises(openai.APIStatusError) as info:
            await s.client().completions.create(model="tiny", prompt="x")
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        assert json.loads(info.value.response.content)["error"]["code"] == "engine_unreachable"
        assert not s.state.fleet.is_ready(s.state.fleet.engines[dead])
        assert s.state.quota._state["alpha"].tokens.level == pytest.approx(1000, abs=1)
        assert s.counted("alpha", "502") == 1


async def test_requests_queue_inside_ext_proc_and_are_shed_at_the_deadline_by_envoy(
    free_port: Callable[[], int],
) -> None:
    engine = FakeEngine(load={"max_num_seqs": 1})
    engine.gate = asyncio.Event()
    cfg = {"max_engine_queue": 0, "max_queue_wait_s": 0.3}
    async with (
        gateway(free_port, [engine], [tenant("alpha", ALPHA)], **cfg) as s,
        httpx.AsyncClient(base_url=s.envoy.url, timeout=10) as http,
    ):
        auth, body = {"authorization": f"Bearer {ALPHA}"}, {"model": "tiny", "prompt": "x"}
        first = asyncio.create_task(http.post("/v1/completions", json=body, headers=auth))
        await wait_until(lambda: engine.active, 300)
        shed = await http.post("/v1/completions", json=body, headers=auth)
        assert (shed.status_code, shed.headers["retry-after"]) == (503, "1")
        assert shed.json()["error"]["code"] == "deadline"
        waiting = asyncio.create_task(http.post("/v1/completions", json=body, headers=auth))
        await wait_until(lambda: s.state.waiting("tiny"), 300)
        assert s.state.waiting("tiny") == 1  # held by the router while Envoy waits on ext_proc
        engine.gate.set()
        assert [(await first).status_code, (await waiting).status_code] == [200, 200]
        assert len(engine.received) == 2


async def envoy_holds(stack: Stack, at: str) -> None:
    """Wait until the router's latest snapshot (with engine ``at``) is Envoy's."""
    async with httpx.AsyncClient() as http:
        for _ in range(300):
            clusters = (await http.get(stack.envoy.admin_url + "/clusters")).text
            if f"kvfleet_engines/tiny::{at}::" in clusters:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"Envoy never got {at} in the tiny cluster")


async def test_a_dead_engine_the_router_chose_is_retried_by_envoy_on_the_live_one(
    free_port: Callable[[], int],
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    live = FakeEngine(load={"num_waiting": 3})  # busier than the dead one looks: the dead one is chosen
    good = EngineLoad(model="tiny", kv_cache_usage=0.0, num_waiting=0, num_running=0, max_num_seqs=8)
    # No load polls while it runs (they would find the dead engine out), and none goes stale.
    cfg = {"load_interval_s": 30.0, "load_stale_s": 300.0}
    async with gateway(free_port, [live], [tenant("alpha", ALPHA)], dead=(dead,), **cfg) as s:
        (live_at,) = s.engines
        served = []
        for prompt in ("a", "b"):
            s.state.fleet.observe(dead, good)  # it died since its last good load
            await envoy_holds(s, dead.removeprefix("http://"))
            raw = await s.client().completions.with_raw_response.create(model="tiny", prompt=prompt)
            served.append((raw.parse().choices[0].text, raw.headers["x-kvfleet-engine"]))
            assert not s.state.fleet.is_ready(s.state.fleet.engines[dead])  # taken out by the retry
        s.state.fleet.observe(dead, good)
        await envoy_holds(s, dead.removeprefix("http://"))
        chunks = await s.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        deltas = [c.choices[0].delta.content async for c in chunks]
        async with httpx.AsyncClient() as http:
            stats = (
                await http.get(s.envoy.admin_url + "/stats", params={"filter": "upstream_rq_retry_success"})
            ).text
    assert served == [("Hello world", live_at), ("Hello world", live_at)]
    assert deltas == ["Hel", "lo", " world"]
    assert [r.get("prompt", "chat") for r in live.received] == ["a", "b", "chat"]
    assert "cluster.kvfleet_engines/tiny.upstream_rq_retry_success: 3" in stats.splitlines()
    assert s.counted("alpha", "200") == 3
    assert s.state.quota.in_flight("alpha") == 0
    assert {u: e.in_flight for u, e in s.state.fleet.engines.items()} == {dead: 0, "http://" + live_at: 0}
