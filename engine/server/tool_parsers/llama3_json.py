"""Llama 3.1/3.2 JSON tool calls: the whole reply is the call(s), ``;``-separated.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply whose first non-blank text is not ``{`` (after an optional ``<|python_tag|>``) is
content, as vLLM's ``llama3_json`` parser reads it.
"""

from __future__ import annotations

from typing import ClassVar

from kvfleet.engine.server.tool_parsers.base import (
    Snapshot,
    ToolParser,
    calls_or_content,
    read_calls,
    separated_by,
)
from kvfleet.engine.server.tool_parsers.json_scan import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name: ClassVar[str] = "llama3_json"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_ws(text, 0)
        rest = text[start:]
        if rest.startswith(PYTHON_TAG):
            start = skip_ws(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(rest):
            return Snapshot("")  # maybe the tag: wait
        if start < len(text) and text[start] != "{":
            return Snapshot(text)
        calls = read_calls(text, start, separated_by(text, ";"))
        return calls_or_content(text, "", calls, final)
