"""The one collect/stream path of both generation routes; each route says only how its JSON looks.

Where it sits: ``routes/completions.py`` and ``routes/chat.py`` validate a request, build the
prompts and ``SamplingParams``, and hand them with a :class:`Shaper` to :func:`respond`. It
submits (:func:`~kvfleet.engine.server.sse.generation_response`), then either streams every
engine delta through :meth:`Shaper.delta_events` (a usage chunk and ``[DONE]`` last) or folds
the deltas into one output per choice and asks the shaper for the choices and the response.
Choice ``i`` of prompt ``p`` has index ``p × n + i``, as OpenAI numbers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any, Generic, TypeVar

from fastapi import Request

from kvfleet.engine.outputs import CompletionOutput, SeqDelta
from kvfleet.engine.server import generation as gen
from kvfleet.engine.server.sse import GenerationStream, generation_response, sse_done
from kvfleet.engine.server.state import ServerState
from kvfleet.openai_responses import Usage

R = TypeVar("R")


class Shaper(Generic[R]):
    """One generation route's response shapes: its stream chunks, its choices, its whole response."""

    def opening(self) -> list[str]:
        """The events before any token (chat: each choice's role)."""
        return []

    def delta_events(self, index: int, delta: SeqDelta, cursor: gen.ChoiceCursor) -> Iterable[str]:
        """The events of choice ``index``'s new tokens (``delta`` has text, logprobs or a finish)."""
        raise NotImplementedError

    def usage_event(self, usage: Usage) -> str:
        raise NotImplementedError

    def choice(self, index: int, out: CompletionOutput) -> Any:
        raise NotImplementedError

    def response(self, choices: list[Any], usage: Usage) -> R:
        raise NotImplementedError


async def respond(
    state: ServerState,
    request: Request,
    shaper: Shaper[R],
    submission: gen.Submission,
    *,
    stream: bool,
    include_usage: bool,
    n: int,
) -> R | GenerationStream:
    async def collect(sub: gen.Submitted) -> R:
        final = await gen.final_outputs(sub, n)
        tokens = sum(len(c.token_ids) for c in final.values())
        prompt = sum(sub.prompt_lens)
        usage = Usage(prompt_tokens=prompt, completion_tokens=tokens, total_tokens=prompt + tokens)
        return shaper.response([shaper.choice(i, final[i]) for i in sorted(final)], usage)

    async def events(sub: gen.Submitted) -> AsyncIterator[str]:
        cursor = gen.ChoiceCursor(n)
        for event in shaper.opening():
            yield event
        async for p, delta in gen.merged(sub.streams):
            for s in delta.seqs:
                index = cursor.choice_index(p, s)
                cursor.record(index, s)
                if s.new_text or s.finish_reason is not None or s.new_logprobs:
                    for event in shaper.delta_events(index, s, cursor):
                        yield event
        if include_usage:
            yield shaper.usage_event(cursor.usage(sum(sub.prompt_lens)))
        yield sse_done()

    return await generation_response(
        state, request, submission, stream=stream, stream_body=events, collect=collect
    )
