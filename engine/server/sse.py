"""Server-sent events for the generation routes, with the request's sequences tied to the response's life.

Where it sits: a router submits its engine requests *before* answering (so a refusal is
still a proper 400), then returns :func:`start_stream`'s response. Whatever ends the
response (the last ``data: [DONE]``, a client that disconnects, an error), its sequences
are aborted if unfinished, freeing their KV blocks, and the in-flight count drops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvfleet.engine.server import generation as gen
from kvfleet.engine.server.state import ServerState
from kvfleet.openai_responses import ErrorResponse

_ERROR = {"model": ErrorResponse}
# Documented for every generation route (the OpenAPI document schemathesis checks against).
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
        "description": "JSON, or SSE when stream",
    },
    400: {**_ERROR, "description": "bad input, naming the field"},
    404: {**_ERROR, "description": "unknown model"},
    503: {**_ERROR, "description": "draining or not ready"},
}


def sse_event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


class GenerationStream(StreamingResponse):
    """An SSE response that aborts its unfinished sequences and releases its in-flight slot when it ends."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def start_stream(
    state: ServerState,
    response_id: str,
    prompts: Sequence[list[int]],
    params: Sequence[gen.SamplingParams],
    priority: int,
    body: Callable[[gen.Submitted], AsyncIterator[str]],
) -> GenerationStream:
    state.in_flight.enter()
    try:
        sub = await gen.submit(state, response_id, prompts, params, priority)
    except BaseException:
        state.in_flight.exit()
        raise

    def close() -> None:
        gen.abort_unfinished(state, sub.streams)
        state.in_flight.exit()

    return GenerationStream(body(sub), close)
