"""Server-sent events for the generation routes, with the request's sequences tied to the response's life.

Where it sits: both generation routes hand their validated prompts to
:func:`generation_response`, which submits the engine requests *before* answering (so a
refusal is still a proper 400), then streams (:func:`start_stream`) or collects. Whatever
ends a stream (the last ``data: [DONE]``, a client that disconnects, an error), its
sequences are aborted if unfinished, freeing their KV blocks, and the in-flight count
drops. Per-token chunks are written from a :class:`ChunkTemplate`, not a pydantic model.
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvfleet.engine.client.async_engine import EngineDeadError
from kvfleet.engine.server import generation as gen
from kvfleet.engine.server.errors import engine_dead_error
from kvfleet.engine.server.state import ServerState
from kvfleet.openai_responses import SSE_EVENT_SCHEMA, ErrorResponse
from kvfleet.streaming import StallBoundedStream

_ERROR = {"model": ErrorResponse}
# Documented for every generation route (the OpenAPI document schemathesis checks against).
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
        "description": "JSON, or SSE when stream",
    },
    400: {**_ERROR, "description": "bad input, naming the field"},
    404: {**_ERROR, "description": "unknown model"},
    503: {**_ERROR, "description": "draining or not ready"},
}


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


# A JSON string literal, non-ASCII kept as UTF-8 (as pydantic writes it); the C encoder.
json_str: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]


def json_scalar(value: str | int | None) -> str:
    if value is None:
        return "null"
    return json_str(value) if isinstance(value, str) else str(int(value))


class ChunkTemplate:
    """One stream's chunk JSON prebuilt around its per-chunk values (no pydantic model per token).

    Invariant: :meth:`render` writes byte for byte what ``sse_event`` of the route's pydantic
    chunk (``CompletionResponse`` / ``ChatCompletionChunk``) writes for a one-choice chunk
    without logprobs or usage; field order is the models' declaration order.
    """

    def __init__(self, response_id: str, obj: str, created: int, model: str, chat: bool) -> None:
        self._head = (
            f'data: {{"id":{json_str(response_id)},"object":{json_str(obj)},"created":{created},'
            f'"model":{json_str(model)},"choices":[{{"index":'
        )
        self._chat = chat

    def render(self, index: int, text: str | None, finish_reason: str | None, stop: str | int | None) -> str:
        body = (
            f'"delta":{{"content":{json_scalar(text)}}}' if self._chat else f'"text":{json_str(text or "")}'
        )
        return (
            f'{self._head}{index},{body},"logprobs":null,"finish_reason":{json_scalar(finish_reason)},'
            f'"stop_reason":{json_scalar(stop)}}}],"usage":null}}\n\n'
        )


def sse_done() -> str:
    return "data: [DONE]\n\n"


async def _ending_cleanly(body: AsyncIterator[str]) -> AsyncIterator[str]:
    """The body's events; if the engine core dies mid-stream, a terminal OpenAI error event (no ``[DONE]``)."""
    try:
        async for event in body:
            yield event
    except EngineDeadError as exc:
        yield f"data: {json.dumps(engine_dead_error(exc).body())}\n\n"
    finally:
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            await aclose()  # its own clean-up now (a client that left), not at garbage collection


class GenerationStream(StallBoundedStream):
    """An SSE response that aborts its unfinished sequences and releases its in-flight slot when it ends
    (also when its client reads nothing for ``stall_timeout_s``: ``--stream-stall-timeout``)."""

    def __init__(
        self, body: AsyncIterator[str], on_close: Callable[[], None], stall_timeout_s: float
    ) -> None:
        super().__init__(
            _ending_cleanly(body), stall_timeout_s=stall_timeout_s, headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def start_stream(
    state: ServerState, submission: gen.Submission, body: Callable[[gen.Submitted], AsyncIterator[str]]
) -> GenerationStream:
    state.in_flight.enter()
    try:
        sub = await gen.submit(state, submission)
    except BaseException:
        state.in_flight.exit()
        raise

    def close() -> None:
        gen.abort_unfinished(state, sub.streams)
        state.in_flight.exit()

    return GenerationStream(body(sub), close, state.stream_stall_timeout_s)


R = TypeVar("R")


async def generation_response(
    state: ServerState,
    request: Request,
    submission: gen.Submission,
    *,
    stream: bool,
    stream_body: Callable[[gen.Submitted], AsyncIterator[str]],
    collect: Callable[[gen.Submitted], Awaitable[R]],
) -> R | GenerationStream:
    """What both generation routes do with their validated prompts: submit, then stream or collect.

    Streaming: the engine requests are submitted before answering (a refusal is still a 400),
    then the SSE response owns them. Whole: the response is collected while a client that
    goes away aborts the sequences; either way the request counts as in flight for the drain.
    """
    if stream:
        return await start_stream(state, submission, stream_body)
    async with state.in_flight.track():
        sub = await gen.submit(state, submission)
        async with gen.abort_on_disconnect(request, state, sub.streams):
            return await collect(sub)
