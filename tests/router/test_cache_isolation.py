"""Tenants and the prefix cache, through a real router and a real engine on ``tiny`` (docs/architecture.md §6).

The router salts each tenant's requests (``cache_salt``), so the engine's prefix cache never
serves one tenant's prompt to another (otherwise time to first token tells a tenant what
another one sent); a router told to share (``--shared-prefix-cache``, or an InferenceService's
``spec.routing.sharedPrefixCache``) lets them share public system prompts. The evidence is the
engine's own ``kvfleet_engine_prefix_cache_hits_total`` counter: prompt tokens served from its cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.router.config import RouterConfig, TenantEntry
from kvfleet.testing.processes import engine_process

from .fakes import served_router

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
BLOCK = 16  # the engine's default block size


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with engine_process("--model", "tiny", "--engine-core", "thread", ready_timeout_s=180) as (url, _):
        yield url


@contextlib.asynccontextmanager
async def router(engine: str, **config: Any) -> AsyncIterator[str]:
    tenants = [TenantEntry.model_validate({"tenant": t, "apiKey": k}) for t, k in KEYS.items()]
    async with served_router(
        RouterConfig(engines=[engine], tenants=tenants, load_interval_s=0.05, **config)
    ) as url:
        yield url


async def cached_tokens(engine: str, url: str, tenant: str, prompt: str, **extra: Any) -> int:
    """Send the tenant's completion; the prompt tokens the engine served from its prefix cache for it."""
    before = await prefix_hits(engine)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0)
    await client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra or None)
    return await prefix_hits(engine) - before


async def prefix_hits(engine: str) -> int:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{engine}/metrics")).text
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "kvfleet_engine_prefix_cache_hits"
    )
    return int(next(s.value for s in family.samples if s.name.endswith("_total")))


def full_blocks(prompt: str) -> int:
    """Prompt tokens a later request can find cached: full blocks, the last token excluded (byte tokens)."""
    return (len(prompt.encode()) - 1) // BLOCK * BLOCK


async def test_one_tenants_prompt_is_never_served_from_the_cache_to_another(engine: str) -> None:
    prompt = "You are the assistant of a private project: the codename is heron. " * 3
    async with router(engine) as url:
        assert await cached_tokens(engine, url, "alice", prompt) == 0
        assert await cached_tokens(engine, url, "bob", prompt) == 0
        assert await cached_tokens(engine, url, "alice", prompt) == full_blocks(prompt)
        assert await cached_tokens(engine, url, "bob", prompt) == full_blocks(prompt)


async def test_a_client_salt_partitions_further_within_its_tenant(engine: str) -> None:
    prompt = "A second private prompt, with a client-given salt on top of the tenant. " * 3
    async with router(engine) as url:
        assert await cached_tokens(engine, url, "alice", prompt, cache_salt="team-1") == 0
        assert await cached_tokens(engine, url, "alice", prompt) == 0
        assert await cached_tokens(engine, url, "bob", prompt, cache_salt="team-1") == 0
        assert await cached_tokens(engine, url, "alice", prompt, cache_salt="team-1") == full_blocks(prompt)


async def test_with_sharing_on_tenants_reuse_a_public_system_prompt(engine: str) -> None:
    prompt = "You are a helpful assistant. This system prompt is public and shared. " * 3
    async with router(engine, shared_prefix_cache=True) as url:
        assert await cached_tokens(engine, url, "alice", prompt) == 0
        assert await cached_tokens(engine, url, "bob", prompt) == full_blocks(prompt)


async def test_an_empty_salt_is_refused_naming_the_field_by_the_router_and_by_the_engine(engine: str) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "cache_salt": ""}
    async with router(engine) as url, httpx.AsyncClient() as http:
        headers = {"Authorization": f"Bearer {KEYS['alice']}"}
        via_router = await http.post(f"{url}/v1/completions", json=body, headers=headers)
        direct = await http.post(f"{engine}/v1/completions", json=body)
    for answer in (via_router, direct):
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "cache_salt"
