"""Reasoning parsers, registered by name (``--reasoning-parser``), as vLLM names them.

Where it sits: the chat route builds one parser per request (:func:`get_reasoning_parser`, with
the request's ``chat_template_kwargs``: Qwen3's ``enable_thinking``) for the parser named on the
command line; :mod:`.base` has the interface and the stream reader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.server.reasoning.base import ReasoningParser
from kvfleet.engine.server.reasoning.gptoss import GptOssParser
from kvfleet.engine.server.reasoning.think import DeepSeekR1Parser, Qwen3Parser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Parser, Qwen3Parser, GptOssParser)
}


def check_reasoning_parser(name: str) -> str:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; known: {sorted(REASONING_PARSERS)}")
    return name


def get_reasoning_parser(name: str, template_kwargs: Mapping[str, Any] | None = None) -> ReasoningParser:
    return REASONING_PARSERS[check_reasoning_parser(name)](template_kwargs)


def request_reasoning(
    name: str | None, template_kwargs: Mapping[str, Any], forced_tool_choice: bool
) -> ReasoningParser | None:
    """A request's parser for ``--reasoning-parser`` ``name``; none for a forced tool choice, whose output the
    tools' schema constrains from its first token (it holds no reasoning)."""
    return None if name is None or forced_tool_choice else get_reasoning_parser(name, template_kwargs)


def keep_markers(params: SamplingParams, parser: ReasoningParser | None) -> SamplingParams:
    """The params, detokenising special tokens too where the parser's markers are special tokens."""
    if parser is None or parser.skip_special_tokens:
        return params
    return dataclasses.replace(params, skip_special_tokens=False)
