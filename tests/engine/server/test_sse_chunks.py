"""The prebuilt chunk JSON of the streaming hot path writes exactly what the pydantic chunk models write."""

from __future__ import annotations

import pytest

from kvfleet.engine.server.sse import ChunkTemplate, sse_event
from kvfleet.openai_responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)

CASES = [
    (0, "a", None, None),
    (3, 'quote " back\\slash\nnew line\ttab', None, None),
    (1, "héllo ✓ 日本 \U0001f600 \x01\x7f\u2028", "length", None),
    (0, "", "stop", "</s>"),
    (2, "x", "stop", 7),
]


@pytest.mark.parametrize(("index", "text", "finish_reason", "stop_reason"), CASES)
def test_a_completion_chunk_is_byte_for_byte_the_models(
    index: int, text: str, finish_reason: str | None, stop_reason: str | int | None
) -> None:
    model = CompletionResponse(
        id="cmpl-1",
        created=1700000000,
        model="tiny",
        choices=[
            CompletionChoice(index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason)
        ],  # type: ignore[arg-type]
    )
    template = ChunkTemplate("cmpl-1", "text_completion", 1700000000, "tiny", chat=False)
    assert template.render(index, text, finish_reason, stop_reason) == sse_event(model)


@pytest.mark.parametrize(("index", "text", "finish_reason", "stop_reason"), CASES)
def test_a_chat_chunk_is_byte_for_byte_the_models(
    index: int, text: str, finish_reason: str | None, stop_reason: str | int | None
) -> None:
    content = text or None  # the routes send a finish-only delta as content null
    model = ChatCompletionChunk(
        id="chatcmpl-1",
        created=1700000000,
        model='my/model "q"',
        choices=[
            ChatChunkChoice(
                index=index,
                delta=ChatDelta(content=content),
                finish_reason=finish_reason,
                stop_reason=stop_reason,  # type: ignore[arg-type]
            )
        ],
    )
    template = ChunkTemplate("chatcmpl-1", "chat.completion.chunk", 1700000000, 'my/model "q"', chat=True)
    assert template.render(index, content, finish_reason, stop_reason) == sse_event(model)
