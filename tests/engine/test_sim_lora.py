"""The simulated engine's adapters: residency with LRU among idle adapters, a load cost, and what a
real engine serves about them (/load, /v1/models, the load/unload endpoints, the metrics)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from kvfleet.engine.lora.config import parse_lora_modules
from kvfleet.engine.sim_lora import SimAdapters
from kvfleet.openai_api import APIError
from kvfleet.protocol import EngineLoad
from kvfleet.testing.processes import engine_process


def adapters(max_loras: int = 2, load_s: float = 0.0) -> SimAdapters:
    return SimAdapters({n: f"/a/{n}" for n in ("a", "b", "c")}, max_loras, load_s)


async def test_a_new_adapter_evicts_the_least_recently_used_idle_one() -> None:
    lora = adapters(max_loras=2)
    for name in ("a", "b", "a"):  # a used last: b is the least recently used
        await lora.acquire(name)
        lora.release(name)
    await lora.acquire("c")
    assert lora.snapshot().resident == ["a", "c"]
    assert lora.metrics.evictions.labels("b")._value.get() == 1
    assert [lora.metrics.loads.labels(n)._value.get() for n in "abc"] == [1, 1, 1]


async def test_with_every_slot_busy_a_request_waits_until_an_adapter_goes_idle() -> None:
    lora = adapters(max_loras=1)
    await lora.acquire("a")
    waiter = asyncio.create_task(lora.acquire("b"))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    assert (lora.snapshot().running, lora.snapshot().waiting, lora.snapshot().resident) == (
        ["a"],
        ["b"],
        ["a"],
    )
    lora.release("a")
    await asyncio.wait_for(waiter, 2)
    assert lora.snapshot().resident == ["b"] and lora.snapshot().waiting == []


async def test_a_request_waits_out_its_adapter_s_load_and_a_resident_adapter_costs_none() -> None:
    lora = adapters(load_s=0.2)
    first = asyncio.create_task(lora.acquire("a"))
    await asyncio.sleep(0.01)  # the load ends 0.2 s after it began, never sooner
    assert not first.done() and lora.snapshot().resident == ["a"] and not lora.loaded["a"].is_set()
    await first
    lora.release("a")
    assert lora.loaded["a"].is_set()  # the next request for it finds it loaded
    await lora.acquire("a")
    assert lora.metrics.loads.labels("a")._value.get() == 1


async def test_bad_adapter_operations_are_refused_naming_the_adapter() -> None:
    lora = adapters()
    with pytest.raises(APIError, match="'a' has already been loaded"):
        lora.add("a", "/x")
    with pytest.raises(APIError, match="'zzz' is not loaded") as gone:
        await lora.remove("zzz")
    assert gone.value.status_code == 404
    await lora.acquire("a")
    with pytest.raises(APIError, match="'a' is in use") as busy:
        await lora.remove("a")
    assert busy.value.status_code == 409
    with pytest.raises(ValueError, match="'x' is not name=path"):
        parse_lora_modules(["x"])


async def test_the_simulated_engine_serves_adapters_as_the_real_one_does() -> None:
    flags = ["--simulate", "--model", "tiny", "--num-kv-blocks", "128", "--sim-base-ms", "1",
             "--lora-modules", "sql=/loras/sql", "chat=/loras/chat", "--max-loras", "1"]  # fmt: skip
    with engine_process(*flags) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        cards = {m.id: m.model_extra for m in (await client.models.list()).data}
        assert cards["sql"] == {"root": "/loras/sql", "parent": "tiny"}
        done = await client.completions.create(model="sql", prompt="SELECT", max_tokens=3)
        assert done.choices[0].text == "abc"
        async with httpx.AsyncClient(base_url=url) as http:
            lora = EngineLoad.model_validate_json((await http.get("/load")).content).lora
            assert lora is not None and (lora.max_loras, lora.resident) == (1, ["sql"])
            added = await http.post("/v1/load_lora_adapter", json={"lora_name": "legal", "lora_path": "/l"})
            assert added.status_code == 200
            again = await http.post("/v1/load_lora_adapter", json={"lora_name": "legal", "lora_path": "/l"})
            assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
            await client.completions.create(model="legal", prompt="hi", max_tokens=2)
            metrics = (await http.get("/metrics")).text
            gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert 'kvfleet:lora_loads_total{adapter="legal"} 1.0' in metrics
        assert 'kvfleet:lora_evictions_total{adapter="sql"} 1.0' in metrics
        assert 'kvfleet:lora_tokens_total{adapter="sql",kind="generation"} 3.0' in metrics
        assert 'kvfleet:lora_requests_total{adapter="legal"} 1.0' in metrics
        assert (
            'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}'
            in metrics
        )
        assert "kvfleet:lora_resident 1.0" in metrics


async def test_a_request_cancelled_during_its_adapter_s_load_does_not_hold_the_adapter() -> None:
    lora = adapters(max_loras=1, load_s=0.5)
    loading = asyncio.create_task(lora.acquire("a"))
    await asyncio.sleep(0.01)
    loading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loading
    await asyncio.sleep(0)  # the release's wake-up runs
    assert lora.snapshot().running == []
    await asyncio.wait_for(lora.acquire("b"), 5)  # a is idle, so b may take its slot
    assert lora.snapshot().resident == ["b"]
