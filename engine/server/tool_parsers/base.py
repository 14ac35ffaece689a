"""The tool-call parser interface: a whole-text parse and an incremental one built on the same snapshot.

Where it sits: the chat route hands a choice's text to a :class:`ToolParser` (chosen by
``--tool-call-parser`` for ``tool_choice: auto``, or one of the forced parsers of
:mod:`.forced` for ``required`` and a named function). A parser only says what the text
holds so far (:meth:`ToolParser.snapshot`); :meth:`ToolParser.parse` reads the whole text
and :class:`ToolStream` turns successive snapshots into OpenAI's stream order: content,
then per call its id and name, then its argument fragments.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from kvfleet.engine.server.tool_parsers.json_scan import is_json, scan_call, skip_ws


@dataclass(frozen=True)
class CallSoFar:
    name: str | None  # None until the model has written it whole
    arguments: str  # the raw JSON argument text written so far
    complete: bool


def calls_or_content(text: str, content: str, calls: list[CallSoFar], final: bool) -> Snapshot:
    """``content`` and ``calls``; but a finished text that holds no named call was all content."""
    if final and not any(c.name is not None for c in calls):
        return Snapshot(text)
    return Snapshot(content, calls)


def read_calls(text: str, pos: int, next_call: Callable[[int], int]) -> list[CallSoFar]:
    """The call objects opening at ``text[pos]`` and then at ``next_call(end of the last one)``, as far as
    the text goes: what every format's parser reads once it has found where its calls begin."""
    calls: list[CallSoFar] = []
    while pos < len(text) and text[pos] == "{":
        scan = scan_call(text, pos)
        if not scan.valid:
            break
        calls.append(CallSoFar(scan.name, scan.arguments, scan.end is not None))
        if scan.end is None:
            break
        pos = next_call(scan.end)
    return calls


def separated_by(text: str, separator: str) -> Callable[[int], int]:
    """``next_call`` of calls written one after another, ``separator`` (and blanks) between them."""

    def after(end: int) -> int:
        pos = skip_ws(text, end)
        return skip_ws(text, pos + 1) if pos < len(text) and text[pos] == separator else pos

    return after


@dataclass(frozen=True)
class Snapshot:
    """What a text holds so far. Invariant: as the text grows, ``content`` and every call's
    ``arguments`` only grow at their ends, calls are only appended, and a name once set stays."""

    content: str
    calls: list[CallSoFar] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


StreamEvent = ContentDelta | CallStart | ArgumentsDelta


class ToolParser:
    """One model family's way of writing tool calls into its text."""

    name: ClassVar[str]
    skip_special_tokens: ClassVar[bool] = True  # False: its call marker is a special token kept in the text

    def snapshot(self, text: str, final: bool) -> Snapshot:
        """What ``text`` holds; ``final``: no more text comes (held-back text is content after all)."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def parse(self, text: str) -> ParsedOutput:
        """The whole text's calls; text that is not a whole, valid call list is all content (as vLLM)."""
        snap = self.snapshot(text, final=True)
        calls = snap.calls
        if not calls or not all(c.name is not None and c.complete and is_json(c.arguments) for c in calls):
            return ParsedOutput(text or None, [])
        return ParsedOutput(
            snap.content or None, [ParsedCall(self.new_call_id(), c.name or "", c.arguments) for c in calls]
        )

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One choice's incremental parse: feed it text deltas, get what is new in stream order."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self._args_sent: list[int] = []  # per started call: argument characters sent

    @property
    def called(self) -> bool:
        return bool(self._args_sent)

    def feed(self, delta: str, final: bool = False) -> list[StreamEvent]:
        self._text += delta
        snap = self._parser.snapshot(self._text, final)
        events: list[StreamEvent] = []
        if len(snap.content) > self._content_sent:
            events.append(ContentDelta(snap.content[self._content_sent :]))
            self._content_sent = len(snap.content)
        for i, call in enumerate(snap.calls):
            if call.name is None:
                break  # its id and name go first: wait for them
            if i == len(self._args_sent):
                events.append(CallStart(i, self._parser.new_call_id(), call.name))
                self._args_sent.append(0)
            if len(call.arguments) > self._args_sent[i]:
                events.append(ArgumentsDelta(i, call.arguments[self._args_sent[i] :]))
                self._args_sent[i] = len(call.arguments)
        return events
