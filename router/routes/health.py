"""``GET /health`` (the process is alive) and ``GET /ready`` (some engine is ready to serve)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from kvfleet.router.deps import State

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(state: State) -> JSONResponse:
    fleet = state.fleet
    models: dict[str, Any] = {m: len(fleet.ready_engines(m)) for m in sorted(fleet.models())}
    ok = any(models.values())
    return JSONResponse({"ready": ok, "ready_engines": models}, status_code=200 if ok else 503)
