"""The reasoning parser interface: a model's text split into its reasoning and the rest, whole or as it streams.

Where it sits: the chat route (and the Responses and Messages routes, which are served by it)
asks the parser of ``--reasoning-parser`` (:mod:`kvfleet.engine.server.reasoning`) to split each
choice's text; the reasoning goes out as ``reasoning_content`` (and vLLM's ``reasoning``), the
rest as the content a tool-call parser then reads. :class:`OutputReader` does both for a stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvfleet.engine.server.tool_parsers.base import ContentDelta, StreamEvent, ToolParser, ToolStream


@dataclass(frozen=True)
class Split:
    """What a text holds so far. Invariant: as the text grows, ``reasoning`` and ``content`` only grow at
    their ends (a marker that may be starting is held back until it is one or is not)."""

    reasoning: str
    content: str  # the text after (or around) the reasoning, for the client or a tool-call parser


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


OutputEvent = ReasoningDelta | StreamEvent


class ReasoningParser:
    """One model family's way of writing its reasoning into its text."""

    name: ClassVar[str]
    skip_special_tokens: ClassVar[bool] = True  # False: its markers are special tokens kept in the text

    def __init__(self, template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.template_kwargs = dict(template_kwargs or {})

    def split(self, text: str, final: bool) -> Split:
        """``final``: no more text comes (held-back text is released)."""
        raise NotImplementedError

    def content_parser(self) -> ToolParser | None:
        """What reads :attr:`Split.content` when no tool-call parser does (None: it is the content)."""
        return None


class OutputReader:
    """One choice's output as it streams: reasoning deltas first, then content and tool calls."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, keep_reasoning: bool
    ) -> None:
        self._reasoning = reasoning
        self._keep = keep_reasoning
        reader = tools if tools is not None else (reasoning.content_parser() if reasoning else None)
        self._tools: ToolStream | None = None if reader is None else reader.stream()
        self._text = ""
        self._reasoning_sent = 0
        self._content_sent = 0

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called

    def feed(self, delta: str, final: bool = False) -> list[OutputEvent]:
        if self._reasoning is None:
            return self._content(delta, final)
        self._text += delta
        split = self._reasoning.split(self._text, final)
        events: list[OutputEvent] = []
        if len(split.reasoning) > self._reasoning_sent:
            if self._keep:
                events.append(ReasoningDelta(split.reasoning[self._reasoning_sent :]))
            self._reasoning_sent = len(split.reasoning)
        events.extend(self._content(split.content[self._content_sent :], final))
        self._content_sent = len(split.content)
        return events

    def _content(self, text: str, final: bool) -> list[OutputEvent]:
        if self._tools is not None:
            return list(self._tools.feed(text, final))
        return [ContentDelta(text)] if text else []
