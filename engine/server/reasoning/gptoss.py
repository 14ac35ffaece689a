"""gpt-oss's reasoning (``openai_gptoss``): its Harmony ``analysis`` messages, apart from the rest.

The reasoning is the ``analysis`` channel's messages (a newline between them, as vLLM joins
them); the rest of the output stays Harmony text, each other message whole with its header, for
the ``openai`` tool-call parser (which reads the calls and the ``final`` answer) or, when the
request has no tools, for :class:`~kvfleet.engine.server.tool_parsers.openai.HarmonyContentParser`.
A message whose header is still arriving goes nowhere until its channel is known.
"""

from __future__ import annotations

from typing import ClassVar

from kvfleet.engine.server.harmony import is_reasoning, joined, read_messages
from kvfleet.engine.server.reasoning.base import ReasoningParser, Split
from kvfleet.engine.server.tool_parsers.base import ToolParser
from kvfleet.engine.server.tool_parsers.openai import HarmonyContentParser


class GptOssParser(ReasoningParser):
    name: ClassVar[str] = "openai_gptoss"
    skip_special_tokens: ClassVar[bool] = False

    def split(self, text: str, final: bool) -> Split:
        messages = read_messages(text, final)
        reasoning = joined([m.text for m in messages if is_reasoning(m)])
        rest = "".join(text[m.span[0] : m.span[1]] for m in messages if not is_reasoning(m))
        return Split(reasoning, rest)

    def content_parser(self) -> ToolParser | None:
        return HarmonyContentParser()
