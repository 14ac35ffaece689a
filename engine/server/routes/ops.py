"""``/health``, ``/ready``, ``/load``, ``/metrics``: what probes, the router and Prometheus read.

Where it sits: ``/health`` is liveness (the engine core, process or thread, is alive); ``/ready`` is
readiness (false while loading or draining, so Kubernetes and the router stop sending);
``/load`` is :class:`kvfleet.protocol.EngineLoad` from the core's latest stats snapshot; and
``/metrics`` renders the app's own Prometheus registry. None of them touches the engine.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from kvfleet.engine.server.state import State
from kvfleet.protocol import EngineLoad, LoraLoad

router = APIRouter(tags=["operations"])


class HealthReport(BaseModel):
    status: str


class Readiness(BaseModel):
    ready: bool
    draining: bool


@router.get("/health", response_model=HealthReport, responses={503: {"model": HealthReport}})
async def health(state: State) -> JSONResponse:
    alive = state.engine.is_running
    return JSONResponse(
        {"status": "ok" if alive else "engine loop stopped"}, status_code=200 if alive else 503
    )


@router.get("/ready", response_model=Readiness, responses={503: {"model": Readiness}})
async def ready(state: State) -> JSONResponse:
    ok = state.ready and not state.draining and state.engine.is_running
    return JSONResponse({"ready": ok, "draining": state.draining}, status_code=200 if ok else 503)


@router.get("/load", response_model=EngineLoad)
async def load(state: State) -> EngineLoad:
    s = state.stats
    queries = s.prefix_cache_queries
    return EngineLoad(
        model=state.model.name,
        kv_cache_usage=min(1.0, max(0.0, s.kv_cache_usage)),
        num_waiting=s.num_waiting,
        num_running=s.num_running,
        max_num_seqs=s.max_num_seqs,
        draining=state.draining,
        ready=state.ready and not state.draining and state.engine.is_running,
        block_size=state.model.block_size,
        num_kv_blocks=s.num_kv_blocks,
        prefix_cache_hit_rate=s.prefix_cache_hits / queries if queries else 0.0,
        lora=None
        if s.lora is None
        else LoraLoad(
            max_loras=s.lora.max_loras,
            resident=list(s.lora.resident),
            running=list(s.lora.running),
            waiting=list(s.lora.waiting),
        ),
    )


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
