"""``<think>…</think>`` reasoning: DeepSeek R1 (``deepseek_r1``) and Qwen3 (``qwen3``), as vLLM reads them.

The model writes its reasoning first, optionally opened by ``<think>`` (a template may have
written that tag into the prompt), closed by ``</think>``; the rest is the content. A text that
never closes its reasoning is all reasoning (the model was cut off while thinking). Qwen3's
``enable_thinking: false`` (``chat_template_kwargs``) makes its template write an empty
``<think></think>`` into the prompt: the output is then all content.
"""

from __future__ import annotations

from typing import ClassVar

from kvfleet.engine.server.reasoning.base import ReasoningParser, Split
from kvfleet.engine.server.tool_parsers.json_scan import held_back

THINK_START, THINK_END = "<think>", "</think>"


class DeepSeekR1Parser(ReasoningParser):
    name: ClassVar[str] = "deepseek_r1"

    def split(self, text: str, final: bool) -> Split:
        if not final and held_back(text, THINK_START) == len(text):
            return Split("", "")  # maybe "<think>" arriving
        before, tag, after = text.partition(THINK_START)
        text = after if tag else before
        reasoning, tag, content = text.partition(THINK_END)
        if tag:
            return Split(reasoning, content)
        return Split(text if final else text[: len(text) - held_back(text, THINK_END)], "")


class Qwen3Parser(DeepSeekR1Parser):
    name: ClassVar[str] = "qwen3"

    @property
    def thinking(self) -> bool:
        return self.template_kwargs.get("enable_thinking", True) is not False

    def split(self, text: str, final: bool) -> Split:
        return super().split(text, final) if self.thinking else Split("", text)
