"""Just enough of a JSON scanner to follow a tool call while its text is still arriving.

Where it sits: the tool-call parsers (:mod:`kvfleet.engine.server.tool_parsers`) read the
model's text as it grows; they need to know where a JSON value ends (or that it has not
ended yet), and the name and raw argument text of a ``{"name": ..., "arguments": ...}``
object so far. Nothing is decoded but the name: arguments are passed on as the model wrote
them, so the streamed fragments and the whole response's arguments are the same text.
"""

from __future__ import annotations

import json
from typing import NamedTuple

_WS = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")  # hermes/mistral write "arguments", Llama 3 "parameters"


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int | None:
    """``text[pos]`` opens a string: the index after its closing quote, None if it has not closed."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


# Invariant: depth counts the brackets opened and not closed since ``pos``, strings skipped whole.
def value_end(text: str, pos: int) -> int | None:
    """The index after the JSON value starting at ``text[pos]``; None while it is incomplete."""
    if pos >= len(text):
        return None
    if text[pos] == '"':
        return string_end(text, pos)
    if text[pos] not in "{[":  # a number, true, false, null: ends at a delimiter
        i = pos
        while i < len(text) and text[i] not in _WS + ",]}":
            i += 1
        return i if i < len(text) else None
    depth, i = 0, pos
    while i < len(text):
        c = text[i]
        if c == '"':
            end = string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


class CallScan(NamedTuple):
    """A ``{"name": ..., "arguments": ...}`` object read so far."""

    name: str | None  # None until its string has closed
    arguments: str  # the raw argument text so far ("{}" once a call without arguments closes)
    end: int | None  # the index after the closing brace; None while open
    valid: bool  # False: not a call object (a wrong key type, a non-string name, ...)


def scan_call(text: str, pos: int) -> CallScan:
    """Read the call object opening at ``text[pos]`` (a ``{``) as far as ``text`` goes."""
    name: str | None = None
    arguments: str | None = None
    i = skip_ws(text, pos + 1)
    while i < len(text):
        if text[i] == "}":
            return CallScan(name, "{}" if arguments is None else arguments, i + 1, name is not None)
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            return CallScan(name, arguments or "", None, False)
        key_end = string_end(text, i)
        if key_end is None:
            break
        key = json.loads(text[i:key_end])
        colon = skip_ws(text, key_end)
        if colon >= len(text):
            break
        if text[colon] != ":":
            return CallScan(name, arguments or "", None, False)
        start = skip_ws(text, colon + 1)
        end = value_end(text, start)
        if key == "name":
            if start < len(text) and text[start] != '"':
                return CallScan(None, "", None, False)
            if end is None:
                break
            name = json.loads(text[start:end])
        elif key in ARGUMENT_KEYS and start < len(text):
            arguments = text[start:] if end is None else text[start:end]
        if end is None:
            break
        i = skip_ws(text, end)
    return CallScan(name, arguments or "", None, True)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag`` (held back from content)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
