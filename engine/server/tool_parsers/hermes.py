"""Hermes (NousResearch Hermes 2 Pro/3, and the fallback prompt kvfleet renders for templates without tools).

The model writes its calls after any content, each as one JSON object between tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first ``<tool_call>``; text between or after calls is dropped
(as vLLM's ``hermes`` parser drops it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from kvfleet.engine.server.tool_parsers.base import Snapshot, ToolParser, calls_or_content, read_calls
from kvfleet.engine.server.tool_parsers.json_scan import held_back, skip_ws


class HermesParser(ToolParser):
    name: ClassVar[str] = "hermes"
    open_tag: ClassVar[str] = "<tool_call>"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        first = text.find(self.open_tag)
        if first < 0:
            return Snapshot(text if final else text[: len(text) - held_back(text, self.open_tag)])
        calls = read_calls(text, skip_ws(text, first + len(self.open_tag)), self._next_tag(text))
        return calls_or_content(text, text[:first], calls, final)

    def _next_tag(self, text: str) -> Callable[[int], int]:
        """``next_call``: the object after the next tag (the text's end where none follows)."""

        def after(end: int) -> int:
            tag = text.find(self.open_tag, end)
            return len(text) if tag < 0 else skip_ws(text, tag + len(self.open_tag))

        return after
