"""``GET /health`` (the process is alive) and ``GET /ready`` (it takes requests; engines listed).

The router is ready as soon as its tenants and discovery are loaded, whatever the engines
do: with scale-to-zero, a request must reach it to bring the first engine up.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kvfleet.router.deps import State

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(state: State) -> dict[str, Any]:
    fleet = state.fleet
    return {"ready": True, "ready_engines": {m: len(fleet.ready_engines(m)) for m in sorted(fleet.models())}}
