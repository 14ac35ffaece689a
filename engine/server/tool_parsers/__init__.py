"""Tool-call parsers, registered by name (``--tool-call-parser``), one module per model family.

Where it sits: the chat route (:mod:`kvfleet.engine.server.tool_calling`) picks the parser
named on the command line for ``tool_choice: auto``; each reads the model's text whole
(:meth:`~.base.ToolParser.parse`) or as it streams (:meth:`~.base.ToolParser.stream`).
"""

from __future__ import annotations

from kvfleet.engine.server.tool_parsers.base import ToolParser
from kvfleet.engine.server.tool_parsers.hermes import HermesParser
from kvfleet.engine.server.tool_parsers.llama3_json import Llama3JsonParser
from kvfleet.engine.server.tool_parsers.mistral import MistralParser
from kvfleet.engine.server.tool_parsers.openai import OpenAIParser
from kvfleet.engine.server.tool_parsers.qwen import QwenParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, OpenAIParser, QwenParser)
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; known: {sorted(PARSERS)}") from None
