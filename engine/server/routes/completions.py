"""``POST /v1/completions``: text completion, whole or streamed as SSE ending in ``data: [DONE]``.

Where it sits: after FastAPI parsed the body into a ``CompletionRequest`` (errors become
OpenAI 400s in ``engine/server/errors.py``), this router tokenizes each prompt, checks it
against the context, submits one engine request per prompt and shapes the outputs. Choice
``i`` of prompt ``p`` has index ``p × n + i``, as OpenAI numbers them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from kvfleet.engine.outputs import TokenLogprob
from kvfleet.engine.server import generation as gen
from kvfleet.engine.server.sse import (
    GENERATION_RESPONSES,
    ChunkTemplate,
    GenerationStream,
    generation_response,
    sse_done,
    sse_event,
)
from kvfleet.engine.server.state import ServerState, State
from kvfleet.openai_api import CompletionRequest
from kvfleet.openai_responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage

router = APIRouter(tags=["completions"])


def _tokenize(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    prompts = []
    for i, p in enumerate(req.prompts()):
        ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
        gen.check_prompt_ids(ids, state.tokenizer.vocab_size, state.model.max_model_len, i)
        prompts.append(ids)
    return prompts


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
async def create_completion(
    body: CompletionRequest, state: State, request: Request
) -> CompletionResponse | GenerationStream:
    lora = state.check_accepting(body.model)
    prompts = _tokenize(state, body)
    params = [
        gen.sampling_params(
            body,
            gen.resolve_max_tokens(body.max_tokens, len(p), state.model.max_model_len),
            body.logprobs,
            state.tokenizer.vocab_size,
        )
        for p in prompts
    ]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    return await generation_response(
        state,
        request,
        stream=body.stream,
        response_id=response_id,
        prompts=prompts,
        params=params,
        priority=body.priority,
        stream_body=lambda sub: _stream(state, body, response_id, sub),
        collect=lambda sub: _collect(state, body, response_id, sub),
        lora=lora,
    )


async def _collect(
    state: ServerState, body: CompletionRequest, response_id: str, sub: gen.Submitted
) -> CompletionResponse:
    final = await gen.final_outputs(sub, body.n)
    choices = []
    for index in sorted(final):
        c = final[index]
        lp = _logprobs(state, c.logprobs or [], 0, body.logprobs) if body.logprobs is not None else None
        choices.append(
            CompletionChoice(
                index=index,
                text=c.text,
                logprobs=lp,
                finish_reason=gen.finish_reason(c),
                stop_reason=c.stop_reason,
            )
        )
    completion_tokens = sum(len(c.token_ids) for c in final.values())
    return CompletionResponse(
        id=response_id,
        created=int(time.time()),
        model=body.model,
        choices=choices,
        usage=Usage(
            prompt_tokens=sum(sub.prompt_lens),
            completion_tokens=completion_tokens,
            total_tokens=sum(sub.prompt_lens) + completion_tokens,
        ),
    )


async def _stream(
    state: ServerState, body: CompletionRequest, response_id: str, sub: gen.Submitted
) -> AsyncIterator[str]:
    created = int(time.time())
    cursor = gen.ChoiceCursor(body.n)
    template = ChunkTemplate(response_id, "text_completion", created, body.model, chat=False)

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse_event(
            CompletionResponse(
                id=response_id, created=created, model=body.model, choices=choices, usage=usage
            )
        )

    async for p, delta in gen.merged(sub.streams):
        for s in delta.seqs:
            index = cursor.choice_index(p, s)
            cursor.record(index, s)
            if not s.new_text and s.finish_reason is None and not s.new_logprobs:
                continue
            if body.logprobs is None:  # the hot path: prebuilt JSON
                yield template.render(index, s.new_text, gen.finish_reason(s), s.stop_reason)
                continue
            lp = _logprobs(state, s.new_logprobs or [], cursor.text_offset(index, s), body.logprobs)
            yield chunk(
                [
                    CompletionChoice(
                        index=index,
                        text=s.new_text,
                        logprobs=lp,
                        finish_reason=gen.finish_reason(s),
                        stop_reason=s.stop_reason,
                    )
                ]
            )
    if body.include_usage:
        yield chunk([], cursor.usage(sum(sub.prompt_lens)))
    yield sse_done()


def _logprobs(
    state: ServerState, items: list[TokenLogprob], offset: int, k: int | None
) -> CompletionLogprobs:
    tokens = [gen.token_text(state, t.token_id) for t in items]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    top = None
    if k:
        top = [{gen.token_text(state, tid): lp for tid, lp in t.top[:k]} for t in items]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[t.logprob for t in items], top_logprobs=top, text_offset=offsets
    )
