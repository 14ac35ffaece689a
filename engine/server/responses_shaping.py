"""What a ``POST /v1/responses`` answer looks like: the response object, its output items, its stream events.

Where it sits: ``routes/responses.py`` generates as the chat route does, then asks a
:class:`ResponseShaper` for the whole response (the output text read by the tool parser into
a ``message`` item and ``function_call`` items, after a ``reasoning`` item when
``--reasoning-parser`` splits reasoning off) or for the stream's events. The stream, as
OpenAI's: ``response.created``, ``response.in_progress``; per item ``response.output_item.added``,
its deltas (``response.reasoning_text.delta``, ``response.output_text.delta`` within a
``content_part``, or ``response.function_call_arguments.delta``), its ``.done`` events and
``response.output_item.done``; last ``response.completed`` carrying the whole response (also
when it is ``incomplete``, as vLLM sends it: the SDK's ``get_final_response`` reads that event).
Every event has ``type`` and a ``sequence_number`` counting from 0, and goes out as
``event: <type>`` + ``data: <json>``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvfleet.engine.outputs import CompletionOutput
from kvfleet.engine.server import generation as gen
from kvfleet.engine.server.reasoning.base import OutputReader, ReasoningDelta, ReasoningParser
from kvfleet.engine.server.tool_calling import ToolPlan
from kvfleet.engine.server.tool_parsers.base import ArgumentsDelta, CallStart, ContentDelta
from kvfleet.openai_api.responses_request import ResponsesRequest


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """OpenAI's reasoning item, the text as a ``reasoning_text`` part (as vLLM returns it)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}  # fmt: skip


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def history_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as the assistant turn of a chat (what a follow-up's prompt continues)."""
    if not output:  # nothing said (a background response not finished, or cancelled): no turn
        return []
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": i["call_id"], "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in output
        if i["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


@dataclass
class ResponseShaper:
    body: ResponsesRequest
    plan: ToolPlan
    id: str = field(default_factory=lambda: _item_id("resp"))
    reasoning: ReasoningParser | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        used: dict[str, Any] | None,
        *,
        reason: str | None = None,
    ) -> dict[str, Any]:
        b = self.body
        choice = b.tool_choice if b.tool_choice is not None else ("auto" if b.tools else "none")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": b.background,
            "error": None,
            "incomplete_details": None if reason is None else {"reason": reason},
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "model": b.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": b.reasoning.model_dump() if b.reasoning else None,
            "store": b.store,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)}
            if b.text and b.text.format
            else {"format": {"type": "text"}},
            "tool_choice": choice.model_dump() if not isinstance(choice, str) else choice,
            "tools": [t.model_dump() for t in b.tools or []],
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled",
            "usage": used,
            "user": b.user,
        }

    def finished(
        self, output: list[dict[str, Any]], reason: str | None, used: dict[str, Any]
    ) -> dict[str, Any]:
        """The response once generation ended with the engine's finish ``reason``."""
        if reason == "length":
            return self.response("incomplete", output, used, reason="max_output_tokens")
        if reason == "abort":
            return self.response("cancelled", output, used)
        return self.response("completed", output, used)

    def whole(self, out: CompletionOutput, prompt_tokens: int) -> dict[str, Any]:
        """A non-streamed response: the output text read into a message and function calls."""
        text, calls, thought, parser = out.text, [], [], self.plan.parser
        if self.reasoning is not None:
            split = self.reasoning.split(out.text, final=True)
            text, parser = split.content, parser or self.reasoning.content_parser()
            thought = [reasoning_item(_item_id("rs"), split.reasoning)] if split.reasoning else []
        if parser is not None:
            parsed = parser.parse(text)
            text = parsed.content or ""
            calls = [call_item(_item_id("fc"), c.id, c.name, c.arguments) for c in parsed.calls]
        output = [message_item(_item_id("msg"), text)] if text or not calls else []
        used = usage(prompt_tokens, len(out.token_ids))
        return self.finished([*thought, *output, *calls], out.finish_reason, used)

    async def events(self, sub: gen.Submitted, on_done: Any = None) -> AsyncIterator[str]:
        """The stream's events; ``on_done(response)`` sees the final response (to store it)."""
        stream = _EventStream(self)
        yield stream.emit("response.created", response=self.response("in_progress", [], None))
        yield stream.emit("response.in_progress", response=self.response("in_progress", [], None))
        reader = OutputReader(self.reasoning, self.plan.parser, keep_reasoning=True)
        tokens, reason = 0, None
        async for _, delta in gen.merged(sub.streams):
            for s in delta.seqs:
                tokens += len(s.new_token_ids)
                final = s.finish_reason is not None
                if final:
                    reason = s.finish_reason
                for piece in reader.feed(s.new_text, final=final):
                    for event in stream.feed(piece):
                        yield event
        for event in stream.close_all():
            yield event
        response = self.finished(stream.output, reason, usage(sum(sub.prompt_lens), tokens))
        if on_done is not None:
            on_done(response)
        yield stream.emit("response.completed", response=response)


class _EventStream:
    """The open output item and the sequence numbers of one stream's events."""

    def __init__(self, shaper: ResponseShaper) -> None:
        self.shaper = shaper
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written (its final shape so far)

    def emit(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def feed(self, piece: Any) -> list[str]:
        events: list[str] = []
        if isinstance(piece, ReasoningDelta):
            if self.open is None or self.open["type"] != "reasoning":
                events += self.close()
                events += self._open(reasoning_item(_item_id("rs"), "", "in_progress"))
            self.open["content"][0]["text"] += piece.text  # type: ignore[index]
            events.append(self._on_open("response.reasoning_text.delta", content_index=0, delta=piece.text))
        elif isinstance(piece, ContentDelta):
            if not piece.text:
                return events
            if self.open is None or self.open["type"] != "message":
                events += self.close()
                events += self._open(message_item(_item_id("msg"), "", "in_progress"))
            part = self.open["content"][0]  # type: ignore[index]
            part["text"] += piece.text
            events.append(
                self._on_open("response.output_text.delta", content_index=0, delta=piece.text, logprobs=[])
            )
        elif isinstance(piece, CallStart):
            events += self.close()
            events += self._open(call_item(_item_id("fc"), piece.id, piece.name, "", "in_progress"))
        elif (
            isinstance(piece, ArgumentsDelta)
            and self.open is not None
            and self.open["type"] == "function_call"
        ):
            self.open["arguments"] += piece.text
            events.append(self._on_open("response.function_call_arguments.delta", delta=piece.text))
        return events

    def close_all(self) -> list[str]:
        events = self.close()
        if all(i["type"] == "reasoning" for i in self.output):  # no text, no call: an empty message, as whole
            events += self._open(message_item(_item_id("msg"), "", "in_progress"))
            events += self.close()
        return events

    def _open(self, item: dict[str, Any]) -> list[str]:
        self.open = item
        events = [self.emit("response.output_item.added", output_index=len(self.output), item=_copy(item))]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._on_open("response.content_part.added", content_index=0, part=part))
        return events

    def _on_open(self, kind: str, **fields: Any) -> str:
        assert self.open is not None
        return self.emit(kind, item_id=self.open["id"], output_index=len(self.output), **fields)

    def close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._on_open("response.reasoning_text.done", content_index=0, text=text))
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._on_open("response.output_text.done", content_index=0, text=part["text"], logprobs=[])
            )
            events.append(self._on_open("response.content_part.done", content_index=0, part=_copy(part)))
        else:
            events.append(
                self._on_open(
                    "response.function_call_arguments.done", name=item["name"], arguments=item["arguments"]
                )
            )
        item["status"] = "completed"
        events.append(self.emit("response.output_item.done", output_index=len(self.output), item=_copy(item)))
        self.output.append(item)
        self.open = None
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(item))
    return copied
