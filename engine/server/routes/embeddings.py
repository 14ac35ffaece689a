"""``POST /v1/embeddings``: OpenAI's embeddings, served by an engine started with ``--runner pooling``.

Where it sits: after FastAPI parsed the body into an ``EmbeddingRequest`` (errors become OpenAI
400s in ``engine/server/errors.py``), this router tokenizes every input, checks each against the
vocabulary and the context, and sends them all to the engine core as one
:class:`~kvfleet.engine.core.messages.EmbedCmd` (``AsyncEngine.embed``), which pools them in
batches the token budget holds (``engine/core/pooling.py``). The vectors come back as float32
bytes: listed as floats, or base64-encoded as they are (``encoding_format``). An engine that
generates answers 400 naming ``model`` and the flag it lacks, as vLLM does.
"""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from fastapi import APIRouter

from kvfleet.engine.sampling_params import RequestError
from kvfleet.engine.server.generation import check_token_ids
from kvfleet.engine.server.sse import GENERATION_RESPONSES
from kvfleet.engine.server.state import ServerState, State
from kvfleet.openai_api import APIError, EmbeddingRequest
from kvfleet.openai_responses import EmbeddingData, EmbeddingResponse, EmbeddingUsage

router = APIRouter(tags=["embeddings"])
RESPONSES = {k: v for k, v in GENERATION_RESPONSES.items() if k != 200}


def _tokenize(state: ServerState, body: EmbeddingRequest) -> list[list[int]]:
    prompts = []
    vocab, limit = state.tokenizer.vocab_size, state.model.max_model_len
    for i, p in enumerate(body.inputs()):
        ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
        where = check_token_ids(ids, vocab, "input", i)
        if len(ids) > limit:
            raise APIError(
                400,
                f"input: {where} is {len(ids)} tokens, but this model's maximum context length is {limit} tokens",
                param="input",
                code="context_length_exceeded",
            )
        prompts.append(ids)
    return prompts


def _encode(vector: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector).decode("ascii")
    return np.frombuffer(vector, dtype="<f4").tolist()  # type: ignore[no-any-return]


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=RESPONSES)
async def create_embeddings(body: EmbeddingRequest, state: State) -> EmbeddingResponse:
    if state.check_accepting(body.model) is not None:
        raise APIError(400, f"model: LoRA adapter {body.model!r} does not serve embeddings", param="model")
    if state.model.runner != "pooling":
        raise APIError(
            400,
            f"model: {state.model.name!r} is served with --runner {state.model.runner}: this engine "
            "serves embeddings only when started with --runner pooling (--task embed)",
            param="model",
        )
    prompts = _tokenize(state, body)
    response_id = f"embd-{uuid.uuid4().hex}"
    async with state.in_flight.track():
        try:
            result = await state.engine.embed(response_id, prompts, body.dimensions)
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.field) from None
    data = [
        EmbeddingData(index=i, embedding=_encode(v, body.encoding_format))
        for i, v in enumerate(result.vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=result.num_prompt_tokens, total_tokens=result.num_prompt_tokens)
    return EmbeddingResponse(
        id=response_id, created=int(time.time()), model=body.model, data=data, usage=usage
    )
