"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models this tenant may use that the fleet serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kvfleet.openai_responses import ErrorResponse, ModelCard, ModelList
from kvfleet.router.deps import AuthTenant, State
from kvfleet.router.fleet import first_poll_done
from kvfleet.router.pipeline import model_card, models_listing

router = APIRouter(tags=["openai"])


_ERRORS: dict[int | str, dict[str, Any]] = {401: {"model": ErrorResponse}}


@router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def list_models(state: State, tenant: AuthTenant) -> dict[str, Any]:
    await first_poll_done(state.fleet)
    return models_listing(state, tenant)


@router.get(
    "/v1/models/{model_id:path}",
    response_model=ModelCard,
    responses={**_ERRORS, 404: {"model": ErrorResponse}},
)
async def retrieve_model(model_id: str, state: State, tenant: AuthTenant) -> dict[str, Any]:
    await first_poll_done(state.fleet)
    return model_card(state, tenant, model_id)
