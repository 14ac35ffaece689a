"""Qwen 2 and 2.5: the same ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks as Hermes.

Their chat templates teach the model Hermes's tags (vLLM serves them with ``hermes``); this
name exists so ``--tool-call-parser qwen`` says which family a deployment serves.
"""

from __future__ import annotations

from typing import ClassVar

from kvfleet.engine.server.tool_parsers.hermes import HermesParser


class QwenParser(HermesParser):
    name: ClassVar[str] = "qwen"
