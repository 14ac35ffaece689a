"""``POST /v1/embeddings`` through a real router and a real pooling engine on ``tiny``: admitted, charged and
logged as a completion is, with its prompt tokens (and no completion tokens) counted as the engine counted them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.router.config import RouterConfig, TenantEntry
from kvfleet.testing.processes import engine_process

from .fakes import served_router

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
TENANTS = [
    {"tenant": "alice", "apiKey": KEYS["alice"]},
    {"tenant": "bob", "apiKey": KEYS["bob"], "limits": {"tokensPerMinute": 300}},
]


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    flags = ("--model", "tiny", "--runner", "pooling", "--engine-core", "thread", "--max-model-len", "512")
    with engine_process(*flags, ready_timeout_s=180) as (url, _):
        yield url


@contextlib.asynccontextmanager
async def router(engine: str, usage_log: Path) -> AsyncIterator[str]:
    tenants = [TenantEntry.model_validate(t) for t in TENANTS]
    config = RouterConfig(engines=[engine], tenants=tenants, load_interval_s=0.05, usage_log=str(usage_log))
    async with served_router(config) as url:
        yield url


def _prompt_tokens_counted(metrics_text: str, tenant: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(metrics_text)
        for s in f.samples
        if s.name == "kvfleet_router_prompt_tokens_total" and s.labels.get("tenant") == tenant
    )


async def test_embeddings_are_charged_their_prompt_tokens_and_logged(engine: str, tmp_path: Path) -> None:
    log = tmp_path / "usage.jsonl"
    async with router(engine, log) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["alice"], max_retries=0)
        out = await client.embeddings.create(model="tiny", input=["Once upon a time", "there was", "a fleet"])
        direct = httpx.post(f"{engine}/v1/embeddings", json={"model": "tiny", "input": "there was"}).json()
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{url}/metrics")).text
    assert len(out.data) == 3  # the engine's own vector, batched with others: float32 rounding apart
    np.testing.assert_allclose(out.data[1].embedding, direct["data"][0]["embedding"], rtol=1e-5, atol=1e-6)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 1
    record: dict[str, Any] = records[0]
    assert (record["tenant"], record["status"], record["model"]) == ("alice", 200, "tiny")
    assert record["prompt_tokens"] == out.usage.prompt_tokens > 0 and record["output_tokens"] == 0
    assert _prompt_tokens_counted(metrics, "alice") == out.usage.prompt_tokens


async def test_a_tenant_over_its_token_quota_gets_a_429(engine: str, tmp_path: Path) -> None:
    async with router(engine, tmp_path / "usage.jsonl") as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["bob"], max_retries=0)
        first = await client.embeddings.create(model="tiny", input="y" * 250)  # ~250 of bob's 300 a minute
        assert first.usage.prompt_tokens >= 250
        with pytest.raises(openai.RateLimitError):
            await client.embeddings.create(model="tiny", input="y" * 250)


@pytest.mark.parametrize(
    ("body", "param"),
    [({"input": []}, "input"), ({"input": "x", "encoding_format": "hex"}, "encoding_format"), ({}, "input")],
)
async def test_bad_input_is_a_400_from_the_router_naming_the_field(
    engine: str, tmp_path: Path, body: dict[str, Any], param: str
) -> None:
    log = tmp_path / "usage.jsonl"
    async with router(engine, log) as url, httpx.AsyncClient() as http:
        r = await http.post(
            f"{url}/v1/embeddings",
            json={"model": "tiny", **body},
            headers={"authorization": f"Bearer {KEYS['alice']}"},
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
