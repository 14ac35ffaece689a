"""Engine kinds: the router reads a vLLM server's /metrics (recorded from vLLM 0.32, and the oldest names) into its load model."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError

from kvfleet.protocol import ENGINE_KINDS, LABEL_ENGINE_KIND
from kvfleet.router.app import build_app
from kvfleet.router.cli import add_arguments, config_from_args
from kvfleet.router.config import RouterConfig, TenantEntry
from kvfleet.router.discovery import Endpoint, FleetView, Service, StaticDiscovery
from kvfleet.router.engine_kinds import KINDS, PollMiss, reader
from kvfleet.router.fleet import Fleet, poll_once
from kvfleet.router.kube import endpoint_of, service_of
from kvfleet.router.prefix import tenant_cache_salt
from kvfleet.router.vllm_metrics import VLLM_DEFAULT_MAX_NUM_SEQS, vllm_load
from kvfleet.testing.processes import free_port

from .conftest import FakeClock
from .fakes import FakeEngine, served

DATA = Path(__file__).parent / "data"
BUSY = (DATA / "vllm-0.32" / "metrics_busy.txt").read_text()
HITS = (DATA / "vllm-0.32" / "metrics_prefix_hits.txt").read_text()
OLDEST = (DATA / "vllm-0.8" / "metrics.txt").read_text()
MODELS = (DATA / "vllm-0.32" / "models.json").read_text()


def test_vllm_0_32_metrics_while_busy_map_to_running_kv_usage_cache_shape_and_adapters() -> None:
    load = vllm_load(BUSY)
    assert (load.model, load.num_running, load.num_waiting) == ("smollm2", 4, 0)
    assert load.kv_cache_usage == pytest.approx(0.02209944751381221)
    assert (load.block_size, load.num_kv_blocks) == (128, 182)
    assert load.max_num_seqs == VLLM_DEFAULT_MAX_NUM_SEQS and load.ready and not load.draining
    assert load.lora is not None
    assert (load.lora.max_loras, load.lora.running, load.lora.waiting) == (2, ["sql"], ["sql"])
    assert load.lora.resident == ["sql"]  # vLLM does not list resident adapters: running or waiting stand in


def test_vllm_0_32_prefix_cache_counters_give_the_hit_rate_and_the_latest_lora_sample_wins() -> None:
    load = vllm_load(HITS)
    assert load.prefix_cache_hit_rate == pytest.approx(384 / 907)
    assert load.num_running == 0 and load.kv_cache_usage == 0.0
    assert load.lora is not None and load.lora.running == [] and load.lora.resident == []


def test_the_oldest_supported_names_gpu_cache_usage_and_gpu_prefix_cache_are_read_too() -> None:
    load = vllm_load(OLDEST)
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (3, 2, 0.25)
    assert load.prefix_cache_hit_rate == pytest.approx(0.25)
    assert (load.block_size, load.num_kv_blocks) == (16, 27000)
    assert load.lora is not None and load.lora.running == ["sql", "chat"] and load.lora.max_loras == 4


def test_a_vllm_server_without_lora_or_cache_info_still_gives_a_load() -> None:
    bare = "\n".join(
        line for line in BUSY.splitlines() if "lora_requests_info" not in line and "cache_config" not in line
    )
    load = vllm_load(bare)
    assert load.lora is None and load.num_kv_blocks == 0 and load.num_running == 4


def test_a_sleeping_vllm_engine_is_not_ready() -> None:
    asleep = BUSY.replace('sleep_state="awake"} 1.0', 'sleep_state="awake"} 0.0')
    assert not vllm_load(asleep).ready


def test_a_page_that_is_not_vllm_metrics_is_refused() -> None:
    with pytest.raises(ValueError, match="vllm:num_requests_running"):
        vllm_load("# HELP kvfleet_engine_x nothing\nkvfleet_engine_x 1.0\n")


def test_every_kind_the_protocol_names_has_a_reader_and_an_unknown_kind_is_an_error_naming_it() -> None:
    assert set(KINDS) == set(ENGINE_KINDS) == {"kvfleet", "vllm"}
    assert reader(None).name == "kvfleet"
    with pytest.raises(ValueError, match="unknown engine kind 'sglang'"):
        reader("sglang")


def test_static_engines_take_a_kind_prefix_or_the_engine_kind_flag() -> None:
    config = RouterConfig(engines=["vllm=http://v:8000/", "http://k:8000"], engine_kind="kvfleet")
    assert config.engines == ["vllm=http://v:8000", "http://k:8000"]
    disc = StaticDiscovery(config.engines, default_kind="vllm")
    view = asyncio.run(disc.view())
    assert [(e.url, e.kind) for e in view.endpoints] == [("http://v:8000", "vllm"), ("http://k:8000", "vllm")]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"engines": ["sglang=http://x:1"]}, "engines"),
        ({"engine_kind": "sglang"}, "engine_kind"),
    ],
)
def test_an_unknown_engine_kind_is_refused_naming_the_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError) as info:
        RouterConfig(**fields)
    text = str(info.value)
    assert named in text and "'sglang'" in text and "kvfleet, vllm" in text


def test_the_cli_reads_engine_kinds_from_both_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--engines", "vllm=http://a:1,http://b:2", "--engine-kind", "vllm"])
    config = config_from_args(args)
    assert isinstance(config, RouterConfig)
    assert config.engines == ["vllm=http://a:1", "http://b:2"] and config.engine_kind == "vllm"


def pod(labels: dict[str, str]) -> dict[str, Any]:
    base = {"app.kubernetes.io/name": "kvfleet-engine", "kvfleet.dev/inferenceservice": "smol"}
    return {
        "metadata": {"name": "p", "namespace": "ns", "labels": {**base, **labels}},
        "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
    }


def test_discovery_takes_the_kind_from_the_pod_label_else_from_the_inference_service(
    clock: FakeClock,
) -> None:
    labelled = endpoint_of(pod({LABEL_ENGINE_KIND: "vllm"}))
    unlabelled = endpoint_of(pod({}))
    assert labelled is not None and labelled.kind == "vllm"
    assert unlabelled is not None and unlabelled.kind is None
    assert endpoint_of(pod({LABEL_ENGINE_KIND: "sglang"})) is None
    isvc = {"metadata": {"name": "smol", "namespace": "ns"}, "spec": {"engine": {"kind": "vllm"}}}
    service = service_of(isvc)
    assert service is not None and service.engine_kind == "vllm"
    assert service_of({**isvc, "spec": {"engine": {"kind": "sglang"}}}) is None
    fleet = Fleet(RouterConfig(), clock)
    fleet.apply_view(FleetView((unlabelled, Endpoint("http://other:1")), (service,)))
    assert fleet.engines[unlabelled.url].kind == "vllm" and fleet.engines["http://other:1"].kind == "kvfleet"


@dataclass
class FakeVllm(FakeEngine):
    """A vLLM server as the router sees it: the recorded /metrics and /v1/models, no /load."""

    def app(self) -> FastAPI:
        app = FastAPI()
        app.get("/metrics", response_class=PlainTextResponse)(self.metrics)
        app.get("/v1/models")(lambda: json.loads(MODELS))
        app.post("/v1/completions")(self.handle)
        app.post("/v1/chat/completions")(self.handle)
        return app

    async def metrics(self) -> str:
        running = 'vllm:num_requests_running{engine="0",model_name="smollm2"} 4.0'
        return BUSY.replace(running, running.replace("4.0", f"{float(self.active)}"))


async def test_a_poll_reads_a_mixed_fleet_each_engine_by_its_kind(clock: FakeClock) -> None:
    kv, vl = FakeEngine(model="smollm2"), FakeVllm(model="smollm2")
    async with served(kv.app(), free_port()) as k, served(vl.app(), free_port()) as v:
        fleet = Fleet(RouterConfig(), clock)
        async with httpx.AsyncClient() as client:
            await poll_once(fleet, StaticDiscovery([k, f"vllm={v}"]), client)
            assert sorted(e.url for e in fleet.ready_engines("smollm2")) == sorted([k, v])
            assert fleet.engines[v].adapters == {"sql"} and fleet.engines[k].adapters == frozenset()
            assert [e.url for e in fleet.ready_engines("sql")] == [v]
            assert await reader("kvfleet").load(client, v, 1.0) is PollMiss.BAD  # a vLLM has no /load


KEY_A, KEY_B = "sk-alice-0123456789", "sk-bob-0123456789"


@contextlib.asynccontextmanager
async def mixed_router() -> AsyncIterator[tuple[str, FakeEngine, FakeVllm]]:
    kv, vl = FakeEngine(model="smollm2"), FakeVllm(model="smollm2")
    tenants = [
        TenantEntry.model_validate({"tenant": t, "apiKey": key})
        for t, key in (("alice", KEY_A), ("bob", KEY_B))
    ]
    async with contextlib.AsyncExitStack() as stack:
        k = await stack.enter_async_context(served(kv.app(), free_port()))
        v = await stack.enter_async_context(served(vl.app(), free_port()))
        app = build_app(RouterConfig(engines=[k, f"vllm={v}"], tenants=tenants, load_interval_s=0.05))
        url = await stack.enter_async_context(served(app, free_port()))
        fleet = app.state.router.fleet
        for _ in range(200):
            if len(fleet.ready_engines("smollm2")) == 2:
                break
            await asyncio.sleep(0.02)
        yield url, kv, vl


async def test_a_vllm_engine_gets_each_tenants_cache_salt_and_the_adapters_it_serves() -> None:
    async with mixed_router() as (url, kv, vl):
        for key in (KEY_A, KEY_B):
            api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            await api.completions.create(model="sql", prompt="SELECT", max_tokens=3)
        assert kv.received == []  # only the vLLM engine serves the adapter
        salts = [body["cache_salt"] for body in vl.received]
        assert salts == [tenant_cache_salt("alice", None), tenant_cache_salt("bob", None)]


def test_a_service_without_a_kind_leaves_its_engines_kvfleet(clock: FakeClock) -> None:
    fleet = Fleet(RouterConfig(), clock)
    fleet.apply_view(FleetView((Endpoint("http://e:1", "ns/s"),), (Service("s", "m", "ns"),)))
    assert fleet.engines["http://e:1"].kind == "kvfleet"
