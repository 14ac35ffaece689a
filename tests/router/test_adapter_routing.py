"""A real router in front of two simulated engines with different resident LoRA adapters: residency
steers placement, a tenant is refused another tenant's adapter, an unknown adapter is not found."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from kvfleet.protocol import HEADER_ENGINE
from kvfleet.router.app import build_app
from kvfleet.router.config import RouterConfig, TenantEntry
from kvfleet.testing.processes import SimFlags, free_port, lora_flags, sim_engines

from .fakes import served

SIM = SimFlags(max_num_seqs=8, num_kv_blocks=256, base_ms=2.0, max_model_len=2048)
LORA = lora_flags(["sql", "chat"], max_loras=1)
ACME, GLOBEX, EVERYONE = "sk-acme-0123456789", "sk-globex-0123456789", "sk-all-0123456789"


def tenant(name: str, key: str, models: list[str]) -> TenantEntry:
    return TenantEntry.model_validate({"tenant": name, "apiKey": key, "models": models})


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    """Two engines, each configured with both adapters and room for one: sql resident on the
    first, chat on the second (each asked for it once, directly)."""
    with sim_engines(2, SIM, LORA) as started:
        urls = [u for u, _ in started]
        for url, adapter in zip(urls, ["sql", "chat"], strict=True):
            body = {"model": adapter, "prompt": "warm", "max_tokens": 1}
            httpx.post(f"{url}/v1/completions", json=body, timeout=30).raise_for_status()
        yield urls


@contextlib.asynccontextmanager
async def router(urls: list[str]) -> AsyncIterator[tuple[str, Any]]:
    tenants = [
        tenant("acme", ACME, ["tiny", "sql"]),
        tenant("globex", GLOBEX, ["tiny", "chat"]),
        tenant("everyone", EVERYONE, []),
    ]
    config = RouterConfig(engines=urls, tenants=tenants, load_interval_s=0.05, load_stale_s=5.0)
    app = build_app(config)
    async with served(app, free_port()) as url:
        state = app.state.router
        for _ in range(500):
            engines = state.fleet.engines.values()
            if all(state.fleet.is_ready(e) and e.adapters for e in engines):
                break
            await asyncio.sleep(0.02)
        yield url, state


async def engine_of(client: openai.AsyncOpenAI, model: str) -> str:
    raw = await client.completions.with_raw_response.create(model=model, prompt="SELECT 1", max_tokens=2)
    return raw.headers[HEADER_ENGINE]


async def test_requests_for_an_adapter_go_to_the_engine_where_it_is_resident(engines: list[str]) -> None:
    sql_home, chat_home = engines
    async with router(engines) as (url, state):
        acme = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=ACME, max_retries=0)
        globex = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=GLOBEX, max_retries=0)
        assert sorted(m.id for m in (await acme.models.list()).data) == ["sql", "tiny"]
        assert [await engine_of(acme, "sql") for _ in range(4)] == [sql_home.removeprefix("http://")] * 4
        assert [await engine_of(globex, "chat") for _ in range(4)] == [chat_home.removeprefix("http://")] * 4
        requests = state.metrics.adapter_requests
        assert requests.labels(adapter="sql", tenant="acme", code="200")._value.get() == 4
        tokens = state.metrics.adapter_tokens.labels(adapter="chat", tenant="globex", kind="generation")
        assert tokens._value.get() == 8


async def test_a_tenant_is_refused_another_tenants_adapter_and_an_unknown_one_is_not_found(
    engines: list[str],
) -> None:
    async with router(engines) as (url, _):
        for key, adapter in [(ACME, "chat"), (GLOBEX, "sql"), (EVERYONE, "sql")]:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.PermissionDeniedError) as refused:
                await client.completions.create(model=adapter, prompt="x", max_tokens=1)
            assert refused.value.body["code"] == "model_not_allowed"  # type: ignore[index]
            assert refused.value.body["param"] == "model"  # type: ignore[index]
        everyone = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=EVERYONE, max_retries=0)
        assert [m.id for m in (await everyone.models.list()).data] == ["tiny"]
        with pytest.raises(openai.NotFoundError) as unknown:
            await everyone.completions.create(model="legal", prompt="x", max_tokens=1)
        assert unknown.value.body["code"] == "model_not_found"  # type: ignore[index]
