"""``GET /v1/models``: the models this tenant may use that the fleet serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kvfleet.router.deps import AuthTenant, State
from kvfleet.router.pipeline import models_listing

router = APIRouter(tags=["openai"])


@router.get("/v1/models")
async def list_models(state: State, tenant: AuthTenant) -> dict[str, Any]:
    return models_listing(state, tenant)
