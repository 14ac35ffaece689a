"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API.

Where it sits: the request (:mod:`kvfleet.anthropic_api`) becomes the equivalent chat completion
request, and from there the chat route's path serves it: tools planned
(:mod:`kvfleet.engine.server.tool_calling`), the prompt rendered by the chat template
(:mod:`kvfleet.engine.server.chat_prompt`), one engine request submitted and collected or
streamed (:func:`~kvfleet.engine.server.sse.generation_response`). Only the shapes differ:
content blocks (``thinking`` first when ``--reasoning-parser`` splits reasoning off, ``text``,
``tool_use``) and Anthropic's stop reasons; a stream is Anthropic's named events
(``message_start``, ``content_block_start``/``_delta``/``_stop`` with ``thinking_delta``,
``text_delta`` or ``input_json_delta``, ``message_delta`` with the stop reason and usage,
``message_stop``), with no ``[DONE]``. Errors are rewritten into Anthropic's error shape by
:class:`~kvfleet.anthropic_api.AnthropicErrors`.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel

from kvfleet.anthropic_api import (
    COUNT_TOKENS,
    MESSAGES,
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
)
from kvfleet.engine.client.async_engine import EngineDeadError
from kvfleet.engine.outputs import CompletionOutput
from kvfleet.engine.server import generation as gen
from kvfleet.engine.server.chat_prompt import chat_prompt_ids
from kvfleet.engine.server.reasoning import keep_markers, request_reasoning
from kvfleet.engine.server.reasoning.base import OutputEvent, OutputReader, ReasoningDelta, ReasoningParser
from kvfleet.engine.server.sse import GenerationStream, generation_response
from kvfleet.engine.server.state import ServerState, State
from kvfleet.engine.server.tool_calling import ToolPlan, constrain, plan_tools
from kvfleet.engine.server.tool_parsers.base import ArgumentsDelta, CallStart, ToolStream
from kvfleet.openai_api import APIError, ChatCompletionRequest

router = APIRouter(tags=["anthropic"])

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # kvfleet signs nothing


ContentBlock = ThinkingContent | TextContent | ToolUseContent


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicError(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicError


_ERROR: dict[str, Any] = {"model": AnthropicErrorResponse}
# What the OpenAPI document says (schemathesis checks the server against it): Anthropic's error shape.
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or Anthropic's SSE events when stream"},
    400: {**_ERROR, "description": "bad input, naming the field"},
    404: {**_ERROR, "description": "unknown model"},
    503: {**_ERROR, "description": "draining or not ready"},
}


# The chat path's field names for what the Messages API calls otherwise (its 400s name the client's field).
_FIELDS = (
    (re.compile(r"^tools\.(\d+)\.function\.parameters"), r"tools.\1.input_schema"),
    (re.compile(r"^stop(?=$|\.)"), "stop_sequences"),
)


@contextlib.contextmanager
def _messages_field_names() -> Iterator[None]:
    try:
        yield
    except APIError as exc:
        for pattern, name in _FIELDS:
            if exc.param is not None and pattern.match(exc.param):
                renamed = pattern.sub(name, exc.param)
                exc.message = exc.message.replace(exc.param, renamed, 1)
                exc.param = renamed
        raise


def _prompt(state: ServerState, chat: ChatCompletionRequest) -> tuple[list[int], ToolPlan]:
    plan = plan_tools(chat, state.tools)
    return chat_prompt_ids(state, chat.message_dicts(), plan.tools, chat.template_kwargs), plan


@router.post(
    COUNT_TOKENS, response_model=TokenCount, responses={k: v for k, v in RESPONSES.items() if k != 200}
)
async def count_tokens(body: CountTokensRequest, state: State) -> TokenCount:
    """The prompt tokens ``/v1/messages`` would submit for the same system, messages and tools."""
    with _messages_field_names():
        chat = body.chat_request()
    state.check_accepting(chat.model)
    tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
    return TokenCount(
        input_tokens=len(chat_prompt_ids(state, chat.message_dicts(), tools, chat.template_kwargs))
    )


@router.post(MESSAGES, response_model=MessageResponse, responses=RESPONSES)
async def create_message(
    body: MessagesRequest, state: State, request: Request
) -> MessageResponse | GenerationStream:
    with _messages_field_names():
        chat = body.chat_request()
        lora = state.check_accepting(chat.model)
        ids, plan = _prompt(state, chat)
        gen.check_prompt_ids(ids, state.tokenizer.vocab_size, state.model.max_model_len, 0)
        max_tokens = gen.resolve_max_tokens(body.max_tokens, len(ids), state.model.max_model_len)
        params = constrain(plan, gen.sampling_params(chat, max_tokens, None, state.tokenizer.vocab_size))
        reasoning = request_reasoning(
            state.tools.reasoning_parser, chat.template_kwargs, plan.schema is not None
        )
    shaper = MessageShaper(body, f"msg_{uuid.uuid4().hex}", plan, reasoning)
    return await generation_response(
        state,
        request,
        gen.Submission(shaper.id, [ids], [keep_markers(params, reasoning)], 0, lora),
        stream=body.stream,
        stream_body=shaper.events,
        collect=shaper.collect,
    )


def _stop(
    reason: str | None, matched: str | int | None, called: bool
) -> tuple[StopReason | None, str | None]:
    """Anthropic's stop reason (and the stop sequence that matched) for the engine's finish."""
    if reason == "length":  # also a call cut short
        return "max_tokens", None
    if called:
        return "tool_use", None
    if reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return ("end_turn", None) if reason is not None else (None, None)


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class MessageShaper:
    """One message's response: whole (:meth:`collect`) or as Anthropic's stream events (:meth:`events`)."""

    def __init__(
        self, body: MessagesRequest, message_id: str, plan: ToolPlan, reasoning: ReasoningParser | None = None
    ) -> None:
        self.body, self.id, self.plan, self.reasoning = body, message_id, plan, reasoning

    def _message(self, content: list[ContentBlock], stop: tuple[StopReason | None, str | None],
                 usage: MessageUsage) -> MessageResponse:  # fmt: skip
        return MessageResponse(
            id=self.id, content=content, model=self.body.model, stop_reason=stop[0], stop_sequence=stop[1],
            usage=usage,
        )  # fmt: skip

    async def collect(self, sub: gen.Submitted) -> MessageResponse:
        out: CompletionOutput = (await gen.final_outputs(sub, 1))[0]
        text, thought, parser = out.text, [], self.plan.parser
        if self.reasoning is not None:
            split = self.reasoning.split(out.text, final=True)
            text, parser = split.content, parser or self.reasoning.content_parser()
            thought = [ThinkingContent(thinking=split.reasoning)] if split.reasoning else []
        content: list[ContentBlock] = [*thought, TextContent(text=text)]
        called = False
        if parser is not None:
            parsed = parser.parse(text)
            content = [*thought, *([TextContent(text=parsed.content)] if parsed.content else [])]
            for c in parsed.calls:
                content.append(ToolUseContent(id=c.id, name=c.name, input=_input(c.arguments)))
            called = bool(parsed.calls)
        usage = MessageUsage(input_tokens=sub.prompt_lens[0], output_tokens=len(out.token_ids))
        return self._message(content, _stop(out.finish_reason, out.stop_reason, called), usage)

    async def events(self, sub: gen.Submitted) -> AsyncIterator[str]:
        # Invariant: at most one content block is open; each block is started, then stopped, once.
        usage = MessageUsage(input_tokens=sub.prompt_lens[0], output_tokens=0)
        start = self._message([], (None, None), usage).model_dump(exclude_none=True)
        yield _event("message_start", {"message": {**start, "stop_reason": None, "stop_sequence": None}})
        stream = OutputReader(self.reasoning, self.plan.parser, keep_reasoning=True)
        blocks = StreamBlocks()
        reason: str | None = None
        matched: str | int | None = None
        try:
            async for _, delta in gen.merged(sub.streams):
                for s in delta.seqs:
                    usage.output_tokens += len(s.new_token_ids)
                    final = s.finish_reason is not None
                    reason, matched = s.finish_reason or reason, s.stop_reason if final else matched
                    for event in tool_events(blocks, stream, s.new_text, final):
                        yield event
        except EngineDeadError as exc:  # the core died mid-stream: Anthropic's terminal error event
            yield _event("error", {"error": anthropic_error_body(503, str(exc))["error"]})
            return
        for event in blocks.close():
            yield event
        stop, sequence = _stop(reason, matched, stream.called)
        yield _event(
            "message_delta",
            {"delta": {"stop_reason": stop, "stop_sequence": sequence}, "usage": usage.model_dump()},
        )
        yield _event("message_stop", {})


def tool_events(blocks: StreamBlocks, stream: OutputReader | ToolStream, text: str, final: bool) -> list[str]:
    return [event for parsed in stream.feed(text, final=final) for event in blocks.feed(parsed)]


class StreamBlocks:
    """The content blocks of a stream, numbered as they open."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's type

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return [*events, _event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        delta = {"index": self.index, "delta": {"type": "text_delta", "text": text}}
        return [*events, _event("content_block_delta", delta)]

    def feed(self, event: OutputEvent) -> list[str]:
        if isinstance(event, ReasoningDelta):
            thinking = {"type": "thinking", "thinking": "", "signature": ""}
            events = self._start(thinking) if self.open != "thinking" else []
            delta = {"index": self.index, "delta": {"type": "thinking_delta", "thinking": event.text}}
            return [*events, _event("content_block_delta", delta)]
        if isinstance(event, CallStart):
            return self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}})
        if isinstance(event, ArgumentsDelta):
            delta = {"index": self.index, "delta": {"type": "input_json_delta", "partial_json": event.text}}
            return [_event("content_block_delta", delta)]
        return self.text(event.text)


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object (arguments that are not a JSON object: under ``"arguments"``)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}
