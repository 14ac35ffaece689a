"""``GET /metrics``: this router's Prometheus registry (docs/architecture.md §8)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet.router.deps import State

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(state: State) -> Response:
    fleet = state.fleet
    state.metrics.engine_up.clear()
    for url, engine in fleet.engines.items():
        state.metrics.engine_up.labels(engine=url).set(1 if fleet.is_ready(engine) else 0)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
