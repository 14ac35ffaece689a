"""gpt-oss's tool calls (``--tool-call-parser openai``): Harmony ``commentary`` messages to ``functions.NAME``.

A call is a message whose recipient is a function, its body the JSON arguments, ended by
``<|call|>`` (a stop token of gpt-oss, so the text may simply end)::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The content is the ``final`` messages and the ``commentary`` messages to no one (preambles), a
newline between them; ``analysis`` messages are no content (the ``openai_gptoss`` reasoning parser
returns them as reasoning). Arguments go out as the model wrote them.
"""

from __future__ import annotations

from typing import ClassVar

from kvfleet.engine.server.harmony import is_content, joined, read_messages
from kvfleet.engine.server.tool_parsers.base import CallSoFar, ParsedCall, ParsedOutput, Snapshot, ToolParser


class OpenAIParser(ToolParser):
    name: ClassVar[str] = "openai"
    skip_special_tokens: ClassVar[bool] = False

    def snapshot(self, text: str, final: bool) -> Snapshot:
        messages = read_messages(text, final)
        calls = [
            CallSoFar(m.function, m.text, m.complete)
            for m in messages
            if m.function is not None and (m.text or m.complete)
        ]
        return Snapshot(joined([m.text for m in messages if is_content(m)]), calls)

    def parse(self, text: str) -> ParsedOutput:
        """The calls and the content; a call's arguments that are not JSON stay as written (as vLLM's)."""
        snap = self.snapshot(text, final=True)
        calls = [ParsedCall(self.new_call_id(), c.name or "", c.arguments) for c in snap.calls]
        return ParsedOutput(snap.content or None, calls)


class HarmonyContentParser(OpenAIParser):
    """The content of a Harmony output served without tools (a call the model wrote anyway is dropped)."""

    name: ClassVar[str] = "harmony_content"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return Snapshot(super().snapshot(text, final).content)
