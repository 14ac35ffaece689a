"""Hermes (NousResearch Hermes 2 Pro/3, and the fallback prompt kvfleet renders for templates without tools).

The model writes its calls after any content, each as one JSON object between tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first ``<tool_call>``; text between or after calls is dropped
(as vLLM's ``hermes`` parser drops it).
"""

from __future__ import annotations

from typing import ClassVar

from kvfleet.engine.server.tool_parsers.base import CallSoFar, Snapshot, ToolParser
from kvfleet.engine.server.tool_parsers.json_scan import held_back, scan_call, skip_ws


class HermesParser(ToolParser):
    name: ClassVar[str] = "hermes"
    open_tag: ClassVar[str] = "<tool_call>"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        first = text.find(self.open_tag)
        if first < 0:
            return Snapshot(text if final else text[: len(text) - held_back(text, self.open_tag)])
        calls: list[CallSoFar] = []
        tag = first
        while tag >= 0:
            start = skip_ws(text, tag + len(self.open_tag))
            if start >= len(text) or text[start] != "{":
                break  # not started yet, or not a JSON object: nothing more to read
            scan = scan_call(text, start)
            if not scan.valid:
                break
            calls.append(CallSoFar(scan.name, scan.arguments, scan.end is not None))
            if scan.end is None:
                break
            tag = text.find(self.open_tag, scan.end)
        if final and not any(c.name is not None for c in calls):
            return Snapshot(text)  # no call after all: it was all content
        return Snapshot(text[:first], calls)
