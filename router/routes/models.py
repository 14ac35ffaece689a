"""``GET /v1/models``: the models this tenant may use that the fleet serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kvfleet.router.deps import AuthTenant, State

router = APIRouter(tags=["openai"])


@router.get("/v1/models")
async def list_models(state: State, tenant: AuthTenant) -> dict[str, Any]:
    names = sorted(m for m in state.fleet.models() if tenant.may_use(m))
    return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "kvfleet"} for m in names]}
