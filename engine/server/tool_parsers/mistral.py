"""Mistral (v0.3 tokenizers): content, then the ``[TOOL_CALLS]`` token and a JSON array of calls.

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

``[TOOL_CALLS]`` is a special token, so requests this parser reads keep special tokens in
the text (``skip_special_tokens=False``, as vLLM's ``mistral`` parser asks); call ids are
nine alphanumeric characters, the only ids Mistral's chat template accepts back.
"""

from __future__ import annotations

import random
import string
from typing import ClassVar

from kvfleet.engine.server.tool_parsers.base import (
    CallSoFar,
    Snapshot,
    ToolParser,
    calls_or_content,
    read_calls,
    separated_by,
)
from kvfleet.engine.server.tool_parsers.json_scan import held_back, skip_ws

BOT = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


def read_call_array(text: str, pos: int) -> list[CallSoFar]:
    """The calls of a JSON array ``[{call}, {call}, ...]`` opening at ``text[pos]``, as far as it goes."""
    return read_calls(text, skip_ws(text, pos + 1), separated_by(text, ","))


def complete_calls(calls: list[CallSoFar]) -> list[CallSoFar]:
    """The calls of an array read so far whose objects have closed: those a cut cannot take back."""
    return [c for c in calls if c.complete and c.name is not None]


class MistralParser(ToolParser):
    name: ClassVar[str] = "mistral"
    skip_special_tokens: ClassVar[bool] = False

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def snapshot(self, text: str, final: bool) -> Snapshot:
        bot = text.find(BOT)
        if bot < 0:
            return Snapshot(text if final else text[: len(text) - held_back(text, BOT)])
        start = skip_ws(text, bot + len(BOT))
        calls = read_call_array(text, start) if start < len(text) and text[start] == "[" else []
        return calls_or_content(text, text[:bot], calls, final)
