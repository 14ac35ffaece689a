"""``POST /v1/chat/completions``: chat, whole or streamed as SSE ending in ``data: [DONE]``, with tool calls.

Where it sits: the messages (and the request's tools, :mod:`kvfleet.engine.server.tool_calling`)
are rendered by the chat template (:mod:`kvfleet.engine.server.chat_prompt`) and encoded
without adding special tokens; one engine request carries the ``n`` choices, through the
shared collect/stream path (:mod:`kvfleet.engine.server.shaping`) with :class:`ChatShaper`.
A stream opens each choice with a ``{"role": "assistant", "content": ""}`` delta, then sends
content deltas, then a delta with the finish reason, then (``stream_options.include_usage``)
a usage chunk. When a tool parser reads the output, its content and calls go out as they are
recognised: a call's id and name first, then its argument fragments (``delta.tool_calls``),
and a choice that called a tool finishes with ``tool_calls``. With ``--reasoning-parser`` the
reasoning it splits off goes out first as ``reasoning_content`` (and vLLM's ``reasoning``), in the
message and as deltas (:mod:`kvfleet.engine.server.reasoning`); ``include_reasoning: false`` drops it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from fastapi import APIRouter, Request

from kvfleet.engine.outputs import CompletionOutput, SeqDelta, TokenLogprob
from kvfleet.engine.server import generation as gen
from kvfleet.engine.server.chat_prompt import chat_prompt_ids
from kvfleet.engine.server.reasoning import keep_markers, request_reasoning
from kvfleet.engine.server.reasoning.base import OutputEvent, OutputReader, ReasoningDelta, ReasoningParser
from kvfleet.engine.server.shaping import Shaper, respond
from kvfleet.engine.server.sse import GENERATION_RESPONSES, ChunkTemplate, GenerationStream, sse_event
from kvfleet.engine.server.state import ServerState, State
from kvfleet.engine.server.tool_calling import ToolPlan, constrain, plan_tools
from kvfleet.engine.server.tool_parsers.base import ArgumentsDelta, CallStart
from kvfleet.openai_api import ChatCompletionRequest
from kvfleet.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaToolCall,
    FinishReason,
    FunctionCall,
    ToolCall,
    TopLogprob,
    Usage,
)

router = APIRouter(tags=["chat"])

__all__ = ["chat_prompt_ids", "router"]


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionRequest, state: State, request: Request
) -> ChatCompletionResponse | GenerationStream:
    lora = state.check_generating(body.model)
    plan = plan_tools(body, state.tools)
    ids = chat_prompt_ids(state, body.message_dicts(), plan.tools, body.template_kwargs)
    gen.check_prompt_ids(ids, state.tokenizer.vocab_size, state.model.max_model_len, 0)
    max_tokens = gen.resolve_max_tokens(body.requested_max_tokens, len(ids), state.model.max_model_len)
    params = gen.sampling_params(body, max_tokens, body.num_logprobs, state.tokenizer.vocab_size)
    reasoning = request_reasoning(state.tools.reasoning_parser, body.template_kwargs, plan.schema is not None)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    return await respond(
        state,
        request,
        ChatShaper(state, body, response_id, plan, reasoning),
        gen.Submission(
            response_id, [ids], [keep_markers(constrain(plan, params), reasoning)], body.priority, lora
        ),
        stream=body.stream,
        include_usage=body.include_usage,
        n=body.n,
    )


def _finish(reason: FinishReason | None, called: bool) -> FinishReason | None:
    return "tool_calls" if called and reason == "stop" else reason


def _delta(event: OutputEvent) -> ChatDelta:
    if isinstance(event, ReasoningDelta):
        return ChatDelta(reasoning=event.text, reasoning_content=event.text)
    if isinstance(event, CallStart):
        function = DeltaFunctionCall(name=event.name, arguments="")
        return ChatDelta(
            tool_calls=[DeltaToolCall(index=event.index, id=event.id, type="function", function=function)]
        )
    if isinstance(event, ArgumentsDelta):
        return ChatDelta(
            tool_calls=[DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))]
        )
    return ChatDelta(content=event.text)


class ChatShaper(Shaper[ChatCompletionResponse]):
    def __init__(
        self,
        state: ServerState,
        body: ChatCompletionRequest,
        response_id: str,
        plan: ToolPlan,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.state, self.body, self.id, self.plan, self.reasoning = state, body, response_id, plan, reasoning
        self.created = int(time.time())
        self.template = ChunkTemplate(
            response_id, "chat.completion.chunk", self.created, body.model, chat=True
        )
        self.readers: dict[int, OutputReader] = {}
        self.parsed = plan.parser is not None or reasoning is not None  # the text is read, not sent as is

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.id, created=self.created, model=self.body.model, choices=choices, usage=usage
        )
        return sse_event(chunk)

    def opening(self) -> list[str]:
        opening = [
            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
            for i in range(self.body.n)
        ]
        return [self._chunk(opening)]

    def delta_events(self, index: int, delta: SeqDelta, cursor: gen.ChoiceCursor) -> Iterable[str]:
        reason = gen.finish_reason(delta)
        if not self.parsed and not self.body.logprobs:  # the hot path: prebuilt JSON
            return [self.template.render(index, delta.new_text or None, reason, delta.stop_reason)]
        lp = self._logprobs(delta.new_logprobs or []) if self.body.logprobs else None
        if not self.parsed:
            deltas = [ChatDelta(content=delta.new_text or None)]
        else:
            stream = self.readers.setdefault(
                index, OutputReader(self.reasoning, self.plan.parser, self.body.include_reasoning)
            )
            events = stream.feed(delta.new_text, final=reason is not None)
            deltas = [_delta(e) for e in events] or ([ChatDelta()] if reason is not None or lp else [])
            reason = _finish(reason, stream.called)
        last = len(deltas) - 1
        return [
            self._chunk(
                [
                    ChatChunkChoice(
                        index=index,
                        delta=d,
                        logprobs=lp if k == 0 else None,
                        finish_reason=reason if k == last else None,
                        stop_reason=delta.stop_reason if k == last else None,
                    )
                ]
            )
            for k, d in enumerate(deltas)
        ]

    def usage_event(self, usage: Usage) -> str:
        return self._chunk([], usage)

    def choice(self, index: int, out: CompletionOutput) -> ChatChoice:
        message, reason = ChatResponseMessage(content=out.text), gen.finish_reason(out)
        text, thought, parser = out.text, None, self.plan.parser
        if self.reasoning is not None:
            split = self.reasoning.split(out.text, final=True)
            text, thought = split.content, (split.reasoning or None) if self.body.include_reasoning else None
            parser = parser or self.reasoning.content_parser()
            message = ChatResponseMessage(content=text or None, reasoning=thought, reasoning_content=thought)
        if parser is not None:
            parsed = parser.parse(text)
            calls = [
                ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in parsed.calls
            ]
            message = ChatResponseMessage(
                content=parsed.content, reasoning=thought, reasoning_content=thought, tool_calls=calls or None
            )
            reason = _finish(reason, bool(calls))
        return ChatChoice(
            index=index,
            message=message,
            logprobs=self._logprobs(out.logprobs or []) if self.body.logprobs else None,
            finish_reason=reason,
            stop_reason=out.stop_reason,
        )

    def response(self, choices: list[ChatChoice], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.body.model, choices=choices, usage=usage
        )

    def _logprobs(self, items: list[TokenLogprob]) -> ChatLogprobs:
        k = self.body.top_logprobs or 0

        def entry(token_id: int, logprob: float) -> TopLogprob:
            raw = self.state.tokenizer.token_bytes(token_id)
            return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))

        content = []
        for t in items:
            e = entry(t.token_id, t.logprob)
            tops = [entry(tid, lp) for tid, lp in t.top[:k]]
            content.append(
                ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes, top_logprobs=tops)
            )
        return ChatLogprobs(content=content)
