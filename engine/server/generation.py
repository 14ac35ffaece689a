"""What completions and chat completions share: prompt checks, sampling params, submission, merged streams.

Where it sits: the two routers turn their request bodies into token-id prompts and a
``SamplingParams`` here, submit one engine request per prompt (``<response id>-<i>``),
then read the engine's deltas through :func:`merged`: a stream writes each delta out as it
comes (:class:`ChoiceCursor` counts tokens for the usage and characters for text offsets),
a whole response folds them into one :class:`CompletionOutput` per choice
(:func:`final_outputs`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

from fastapi import Request

from kvfleet.engine.client.request_stream import RequestStream
from kvfleet.engine.outputs import CompletionOutput, ReqDelta, SeqDelta
from kvfleet.engine.sampling_params import SamplingParams, SamplingParamsError
from kvfleet.engine.server.state import ServerState
from kvfleet.engine.server.structured_request import structured_spec
from kvfleet.openai_api import APIError, ChatCompletionRequest, CompletionRequest
from kvfleet.openai_responses import FinishReason, Usage

DISCONNECT_POLL_S = 0.2


def check_token_ids(ids: list[int], vocab_size: int, param: str, index: int) -> str:
    """A 400 naming ``param`` for an empty item or a token outside the vocabulary, as the generation
    routes and ``routes/embeddings.py`` check theirs; returns the item's name (``param[index]`` past 0)."""
    where = param if index == 0 else f"{param}[{index}]"
    if not ids:
        raise APIError(400, f"{where}: the {param} is empty (0 tokens)", param=param)
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise APIError(
            400, f"{where}: token id {bad} is outside the vocabulary (size {vocab_size})", param=param
        )
    return where


def check_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int, index: int) -> None:
    where = check_token_ids(ids, vocab_size, "prompt", index)
    if len(ids) >= max_model_len:
        raise APIError(
            400,
            f"{where}: the prompt is {len(ids)} tokens, but this model's maximum context length is "
            f"{max_model_len} tokens (prompt and completion together)",
            param="prompt",
            code="context_length_exceeded",
        )


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """The completion budget: the request's, or what the context leaves; over the context is a 400."""
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            400,
            f"max_tokens: this model's maximum context length is {max_model_len} tokens, but the request "
            f"asks for {prompt_len + requested} ({prompt_len} in the prompt, {requested} for the completion)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    """The request's sampling settings; a logit_bias id outside the vocabulary, min_tokens over the budget
    or a bad structured-output constraint is a 400."""
    structured = structured_spec(req)
    bias = req.logit_bias_ids
    bad = next((t for t in bias if t >= vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"logit_bias: token id {bad} is outside the vocabulary (size {vocab_size})",
            param="logit_bias",
        )
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=None if req.top_k in (None, -1) else req.top_k,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple(req.stop_list),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=tuple(bias.items()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            cache_salt=req.cache_salt,
            structured=structured,
        )
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.field) from None


@dataclass
class Submitted:
    streams: list[RequestStream]
    prompt_lens: list[int]


class Submission(NamedTuple):
    """What a generation route asks of the engine: one request per prompt, ids ``<response_id>-<i>``,
    under the adapter ``lora`` (None: the base model)."""

    response_id: str
    prompts: Sequence[list[int]]
    params: Sequence[SamplingParams]
    priority: int = 0
    lora: str | None = None


async def submit(state: ServerState, submission: Submission) -> Submitted:
    """One engine request per prompt; if the engine refuses one, the ones already added are aborted."""
    response_id, prompts, params, priority, lora = submission
    streams: list[RequestStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            streams.append(
                await state.engine.generate(f"{response_id}-{i}", ids, p, priority=priority, lora=lora)
            )
            if state.tracing is not None:  # engine/server/tracing.py: the request joins its caller's trace
                state.tracing.bind(f"{response_id}-{i}", p.max_tokens, lora)
    except ValueError as exc:
        abort_unfinished(state, streams)
        raise APIError(400, str(exc), param=getattr(exc, "field", None)) from None
    except BaseException:
        abort_unfinished(state, streams)
        raise
    return Submitted(streams, [len(p) for p in prompts])


async def final_outputs(sub: Submitted, n: int) -> dict[int, CompletionOutput]:
    """Each choice's whole output (choice = prompt index × n + sample index), for a non-streamed response."""
    final: dict[int, CompletionOutput] = {}
    async for p, delta in merged(sub.streams):
        for s in delta.seqs:
            index = p * n + s.choice
            if index not in final:
                final[index] = CompletionOutput(s.choice)
            final[index].add(s)
    return final


def abort_unfinished(state: ServerState, streams: Sequence[RequestStream]) -> None:
    for s in streams:
        if not s.finished:
            state.engine.abort(s.request_id)


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, ReqDelta]]:
    """(prompt index, delta) from every stream, in the order they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, ReqDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


@contextlib.asynccontextmanager
async def abort_on_disconnect(
    request: Request, state: ServerState, streams: Sequence[RequestStream]
) -> AsyncIterator[None]:
    """While the body runs, a client that goes away aborts the streams' sequences (non-streaming path)."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        abort_unfinished(state, streams)

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


class ChoiceCursor:
    """Per choice (prompt index × n + sample index) of a stream: the tokens and characters sent so far."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.completion_tokens: dict[int, int] = {}
        self.sent_chars: dict[int, int] = {}

    def choice_index(self, prompt_index: int, delta: SeqDelta) -> int:
        return prompt_index * self.n + delta.choice

    def record(self, choice: int, delta: SeqDelta) -> None:
        self.completion_tokens[choice] = self.completion_tokens.get(choice, 0) + len(delta.new_token_ids)

    def text_offset(self, choice: int, delta: SeqDelta) -> int:
        """Where the delta's new text starts in the choice's text (call once per delta sent)."""
        offset = self.sent_chars.get(choice, 0)
        self.sent_chars[choice] = offset + len(delta.new_text)
        return offset

    def usage(self, prompt_tokens: int) -> Usage:
        tokens = sum(self.completion_tokens.values())
        return Usage(
            prompt_tokens=prompt_tokens, completion_tokens=tokens, total_tokens=prompt_tokens + tokens
        )


def finish_reason(out: CompletionOutput | SeqDelta) -> FinishReason | None:
    """The engine's finish reason; SequenceStatus has exactly OpenAI's three (and vLLM's "abort")."""
    return cast("FinishReason | None", out.finish_reason)


def token_text(state: ServerState, token_id: int) -> str:
    return state.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
