"""``POST /v1/completions``: text completion, whole or streamed as SSE ending in ``data: [DONE]``.

Where it sits: after FastAPI parsed the body into a ``CompletionRequest`` (errors become
OpenAI 400s in ``engine/server/errors.py``), this router tokenizes each prompt, checks it
against the context and hands one engine request per prompt to the shared collect/stream
path (:mod:`kvfleet.engine.server.shaping`) with :class:`CompletionShaper`, its JSON shapes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from fastapi import APIRouter, Request

from kvfleet.engine.outputs import CompletionOutput, SeqDelta, TokenLogprob
from kvfleet.engine.server import generation as gen
from kvfleet.engine.server.shaping import Shaper, respond
from kvfleet.engine.server.sse import GENERATION_RESPONSES, ChunkTemplate, GenerationStream, sse_event
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
    lora = state.check_generating(body.model)
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
    return await respond(
        state,
        request,
        CompletionShaper(state, body, response_id),
        gen.Submission(response_id, prompts, params, body.priority, lora),
        stream=body.stream,
        include_usage=body.include_usage,
        n=body.n,
    )


class CompletionShaper(Shaper[CompletionResponse]):
    def __init__(self, state: ServerState, body: CompletionRequest, response_id: str) -> None:
        self.state, self.body, self.id = state, body, response_id
        self.created = int(time.time())
        self.template = ChunkTemplate(response_id, "text_completion", self.created, body.model, chat=False)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse_event(self.response(choices, usage))

    def delta_events(self, index: int, delta: SeqDelta, cursor: gen.ChoiceCursor) -> Iterable[str]:
        reason = gen.finish_reason(delta)
        if self.body.logprobs is None:  # the hot path: prebuilt JSON
            return [self.template.render(index, delta.new_text, reason, delta.stop_reason)]
        lp = self._logprobs(delta.new_logprobs or [], cursor.text_offset(index, delta))
        choice = CompletionChoice(
            index=index, text=delta.new_text, logprobs=lp, finish_reason=reason, stop_reason=delta.stop_reason
        )
        return [self._chunk([choice])]

    def usage_event(self, usage: Usage) -> str:
        return self._chunk([], usage)

    def choice(self, index: int, out: CompletionOutput) -> CompletionChoice:
        lp = self._logprobs(out.logprobs or [], 0) if self.body.logprobs is not None else None
        return CompletionChoice(
            index=index,
            text=out.text,
            logprobs=lp,
            finish_reason=gen.finish_reason(out),
            stop_reason=out.stop_reason,
        )

    def response(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.body.model, choices=choices, usage=usage
        )

    def _logprobs(self, items: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        tokens = [gen.token_text(self.state, t.token_id) for t in items]
        offsets, pos = [], offset
        for text in tokens:
            offsets.append(pos)
            pos += len(text)
        k = self.body.logprobs
        top = None
        if k:
            top = [{gen.token_text(self.state, tid): lp for tid, lp in t.top[:k]} for t in items]
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[t.logprob for t in items], top_logprobs=top, text_offset=offsets
        )
