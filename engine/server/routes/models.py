"""``GET /v1/models``, ``GET /v1/models/{id}`` and ``POST /tokenize``: what the server serves and how it counts tokens.

Where it sits: read-only views of the ``ServedModel`` and the tokenizer; clients (and the
router's admission estimates) use ``/tokenize`` to count a prompt's tokens exactly as the
generation routes will.
"""

from __future__ import annotations

from fastapi import APIRouter

from kvfleet.engine.server.chat_prompt import chat_prompt_ids
from kvfleet.engine.server.sse import GENERATION_RESPONSES
from kvfleet.engine.server.state import ServerState, State
from kvfleet.openai_api import TokenizeRequest, model_not_found
from kvfleet.openai_responses import ModelCard, ModelList, TokenizeResponse

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


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses={k: v for k, v in GENERATION_RESPONSES.items() if k in (400, 404)},
)
async def tokenize(body: TokenizeRequest, state: State) -> TokenizeResponse:
    if body.model is not None and body.model != state.model.name and body.model not in state.adapters:
        raise model_not_found(body.model, state.model.name)
    if body.prompt is not None:
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        ids = chat_prompt_ids(state, [m.template_dict() for m in body.messages or []])
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.model.max_model_len)
