"""``POST /v1/chat/completions``: chat, whole or streamed as SSE ending in ``data: [DONE]``.

Where it sits: the messages are rendered by the tokenizer's chat template and encoded
without adding special tokens (the template holds them, as transformers does it); one
engine request carries the ``n`` choices. A stream opens each choice with a
``{"role": "assistant", "content": ""}`` delta, then sends content deltas, then a delta
with the finish reason, then (``stream_options.include_usage``) a usage chunk.
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
from kvfleet.openai_api import APIError, ChatCompletionRequest
from kvfleet.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
    Usage,
)

router = APIRouter(tags=["chat"])


def chat_prompt_ids(state: ServerState, messages: list[dict[str, str]]) -> list[int]:
    try:
        text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:  # ChatTemplateError: no template, or it refused the messages
        raise APIError(400, f"messages: {exc}", param="messages") from None
    return state.tokenizer.encode(text, add_special_tokens=False)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionRequest, state: State, request: Request
) -> ChatCompletionResponse | GenerationStream:
    lora = state.check_accepting(body.model)
    ids = chat_prompt_ids(state, body.message_dicts())
    gen.check_prompt_ids(ids, state.tokenizer.vocab_size, state.model.max_model_len, 0)
    max_tokens = gen.resolve_max_tokens(body.requested_max_tokens, len(ids), state.model.max_model_len)
    params = gen.sampling_params(body, max_tokens, body.num_logprobs, state.tokenizer.vocab_size)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    return await generation_response(
        state,
        request,
        stream=body.stream,
        response_id=response_id,
        prompts=[ids],
        params=[params],
        priority=body.priority,
        stream_body=lambda sub: _stream(state, body, response_id, sub),
        collect=lambda sub: _collect(state, body, response_id, sub),
        lora=lora,
    )


async def _collect(
    state: ServerState, body: ChatCompletionRequest, response_id: str, sub: gen.Submitted
) -> ChatCompletionResponse:
    final = await gen.final_outputs(sub, body.n)
    choices = [
        ChatChoice(
            index=i,
            message=ChatResponseMessage(content=c.text),
            logprobs=_logprobs(state, c.logprobs or [], body.top_logprobs or 0) if body.logprobs else None,
            finish_reason=gen.finish_reason(c),
            stop_reason=c.stop_reason,
        )
        for i, c in sorted(final.items())
    ]
    tokens = sum(len(c.token_ids) for c in final.values())
    prompt = sub.prompt_lens[0]
    return ChatCompletionResponse(
        id=response_id,
        created=int(time.time()),
        model=body.model,
        choices=choices,
        usage=Usage(prompt_tokens=prompt, completion_tokens=tokens, total_tokens=prompt + tokens),
    )


async def _stream(
    state: ServerState, body: ChatCompletionRequest, response_id: str, sub: gen.Submitted
) -> AsyncIterator[str]:
    created = int(time.time())
    cursor = gen.ChoiceCursor(body.n)
    template = ChunkTemplate(response_id, "chat.completion.chunk", created, body.model, chat=True)

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=response_id, created=created, model=body.model, choices=choices, usage=usage
            )
        )

    yield chunk(
        [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(body.n)]
    )
    async for _, delta in gen.merged(sub.streams):
        for s in delta.seqs:
            cursor.record(s.choice, s)
            if not s.new_text and s.finish_reason is None and not s.new_logprobs:
                continue
            if not body.logprobs:  # the hot path: prebuilt JSON
                yield template.render(s.choice, s.new_text or None, gen.finish_reason(s), s.stop_reason)
                continue
            lp = _logprobs(state, s.new_logprobs or [], body.top_logprobs or 0)
            yield chunk(
                [
                    ChatChunkChoice(
                        index=s.choice,
                        delta=ChatDelta(content=s.new_text or None),
                        logprobs=lp,
                        finish_reason=gen.finish_reason(s),
                        stop_reason=s.stop_reason,
                    )
                ]
            )
    if body.include_usage:
        yield chunk([], cursor.usage(sub.prompt_lens[0]))
    yield sse_done()


def _logprobs(state: ServerState, items: list[TokenLogprob], k: int) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> TopLogprob:
        raw = state.tokenizer.token_bytes(token_id)
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))

    content = []
    for t in items:
        e = entry(t.token_id, t.logprob)
        tops = [entry(tid, lp) for tid, lp in t.top[:k]]
        content.append(ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes, top_logprobs=tops))
    return ChatLogprobs(content=content)
