"""``GET /v1/models`` and ``GET /v1/models/{id}``: what the server serves.

Where it sits: read-only views of the ``ServedModel`` and its adapters; how it counts tokens
(``/tokenize``, ``/detokenize``) is :mod:`kvfleet.engine.server.routes.tokenize`.
"""

from __future__ import annotations

from fastapi import APIRouter

from kvfleet.engine.server.sse import GENERATION_RESPONSES
from kvfleet.engine.server.state import ServerState, State
from kvfleet.openai_api import model_not_found
from kvfleet.openai_responses import ModelCard, ModelList

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: State) -> ModelList:
    return ModelList(data=_cards(state))


@router.get(
    "/v1/models/{model_id:path}",
    response_model=ModelCard,
    responses={k: v for k, v in GENERATION_RESPONSES.items() if k == 404},
)
async def retrieve_model(model_id: str, state: State) -> ModelCard:
    card = next((c for c in _cards(state) if c.id == model_id), None)
    if card is None:
        raise model_not_found(model_id, state.model.name)
    return card


def _cards(state: ServerState) -> list[ModelCard]:
    """The base model, then each LoRA adapter (``parent``: the base model)."""
    m = state.model
    base = ModelCard(id=m.name, created=m.created, max_model_len=m.max_model_len, root=m.name)
    adapters = [
        ModelCard(id=name, created=m.created, max_model_len=m.max_model_len, root=path, parent=m.name)
        for name, path in state.adapters.items()
    ]
    return [base, *adapters]
