"""``GET /v1/models`` and ``POST /tokenize``: what the server serves and how it counts tokens.

Where it sits: read-only views of the ``ServedModel`` and the tokenizer; clients (and the
router's admission estimates) use ``/tokenize`` to count a prompt's tokens exactly as the
generation routes will.
"""

from __future__ import annotations

from fastapi import APIRouter

from kvfleet.engine.server.routes.chat import chat_prompt_ids
from kvfleet.engine.server.sse import GENERATION_RESPONSES
from kvfleet.engine.server.state import State
from kvfleet.openai_api import ChatMessage, TokenizeRequest, model_not_found
from kvfleet.openai_responses import ModelCard, ModelList, TokenizeResponse

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: State) -> ModelList:
    m = state.model
    base = ModelCard(id=m.name, created=m.created, max_model_len=m.max_model_len, root=m.name)
    adapters = [
        ModelCard(id=name, created=m.created, max_model_len=m.max_model_len, root=path, parent=m.name)
        for name, path in state.adapters.items()
    ]
    return ModelList(data=[base, *adapters])


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
        ids = chat_prompt_ids(state, _dicts(body.messages or []))
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.model.max_model_len)


def _dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text} for m in messages]
