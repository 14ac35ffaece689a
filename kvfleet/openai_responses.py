"""The OpenAI-compatible responses the engine sends: whole responses, stream chunks, the error body's model.

Where it sits: ``engine/server`` builds these from ``RequestOutput``s and serialises them
(whole, or one per SSE ``data:`` line); the router and ``kvfleet bench`` read the same
shapes back. Torch-free, like the request side in :mod:`kvfleet.openai_api`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "abort", "tool_calls"]

# One server-sent event of a stream, as OpenAPI documents ``text/event-stream`` (and schemathesis
# checks each event against it): its ``data`` is a chunk's JSON, or ``[DONE]``.
SSE_EVENT_SCHEMA = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # vLLM extension: the stop string or token id that matched


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always set on a whole response; on a stream only in the last chunk


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    """One call of ``message.tool_calls`` (ids ``chatcmpl-tool-<hex>``, as vLLM's)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _none(value: object) -> bool:
    return value is None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = Field(default=None, exclude_if=_none)  # vLLM's name (--reasoning-parser) ...
    reasoning_content: str | None = Field(default=None, exclude_if=_none)  # ... and its older one
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_none)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=_none)
    arguments: str | None = Field(default=None, exclude_if=_none)


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: its first one carries ``id``, ``type`` and the name; the
    next ones carry argument fragments, which concatenate to the call's arguments."""

    index: int
    id: str | None = Field(default=None, exclude_if=_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_none)
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_none)
    content: str | None = None
    reasoning: str | None = Field(default=None, exclude_if=_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvfleet"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's path (the base model's name for the base), as vLLM
    parent: str | None = None  # a LoRA adapter's base model; None for the base model itself


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a string: base64 of the little-endian float32 vector (encoding_format)


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
