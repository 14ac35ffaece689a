"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them: the server's tokenizer, no engine step.

Where it sits: beside the generation routes, on the same tokenizer and chat template
(:mod:`kvfleet.engine.server.chat_prompt`): clients count a prompt's tokens here exactly as the
generation routes will (a chat's ``/tokenize`` count is the ``prompt_tokens`` its completion
reports). A prompt is encoded with special tokens (unless
``add_special_tokens`` is false); chat messages are rendered by the template, which writes the
special tokens itself (``add_special_tokens`` defaults to false there, as in vLLM).
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from kvfleet.engine.server.chat_prompt import chat_text
from kvfleet.engine.server.sse import GENERATION_RESPONSES
from kvfleet.engine.server.state import ServerState, State
from kvfleet.openai_api import APIError, DetokenizeRequest, TokenizeRequest
from kvfleet.openai_responses import TokenizeResponse

router = APIRouter(tags=["tokenizer"])

_RESPONSES = {k: v for k, v in GENERATION_RESPONSES.items() if k != 200}


class DetokenizeResponse(BaseModel):
    prompt: str


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None:
        state.check_accepting(model)


def _chat_text(state: ServerState, body: TokenizeRequest) -> str:
    assert body.messages is not None
    messages = [m.template_dict() for m in body.messages]
    return chat_text(state, messages, None, body.chat_template_kwargs, body.add_generation_prompt)


@router.post("/tokenize", response_model=TokenizeResponse, responses=_RESPONSES)
async def tokenize(body: TokenizeRequest, state: State) -> TokenizeResponse:
    _check_model(state, body.model)
    tok = state.tokenizer
    if body.prompt is not None:
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        special = body.add_special_tokens and "add_special_tokens" in body.model_fields_set
        ids = tok.encode(_chat_text(state, body), add_special_tokens=special)
    strs = (
        [tok.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
        if body.return_token_strs
        else None
    )
    return TokenizeResponse(
        count=len(ids), max_model_len=state.model.max_model_len, tokens=ids, token_strs=strs
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_RESPONSES)
async def detokenize(body: DetokenizeRequest, state: State) -> DetokenizeResponse:
    _check_model(state, body.model)
    vocab = state.tokenizer.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if t >= vocab), None)
    if bad is not None:
        raise APIError(
            400,
            f"tokens.{bad}: token id {body.tokens[bad]} is outside the vocabulary (size {vocab})",
            param=f"tokens.{bad}",
        )
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
