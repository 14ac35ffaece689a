"""The parsers of forced tool choices, whose output a JSON schema constrains (not chosen by flag).

``tool_choice: "required"``: the output is a JSON array of ``{"name", "parameters"}`` objects
(the schema of :func:`kvfleet.engine.server.tool_calling.required_schema`). A named function:
the output is that function's arguments object and nothing else. Both are read directly as
JSON, as vLLM reads them, not by the model family's parser.

A required array cut short (``max_tokens`` reached: finish reason ``length``) still gives every
call that closed before the cut; the call the cut fell in is dropped. So that a stream says the
same as the whole response, a required call goes out (id, name, then its arguments in one
fragment) once its object has closed: a stream never sends a call it would have to take back.
"""

from __future__ import annotations

from typing import ClassVar

from kvfleet.engine.server.tool_parsers.base import (
    CallSoFar,
    ParsedCall,
    ParsedOutput,
    Snapshot,
    ToolParser,
)
from kvfleet.engine.server.tool_parsers.json_scan import is_json, skip_ws
from kvfleet.engine.server.tool_parsers.mistral import complete_calls, read_call_array


class RequiredParser(ToolParser):
    name: ClassVar[str] = "required"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_ws(text, 0)
        if start >= len(text) or text[start] != "[":
            return Snapshot("")
        return Snapshot("", complete_calls(read_call_array(text, start)))

    def parse(self, text: str) -> ParsedOutput:
        """The array's closed calls, whether or not the array itself closed; none: the text is content."""
        calls = [c for c in self.snapshot(text, final=True).calls if is_json(c.arguments)]
        if not calls:
            return ParsedOutput(text or None, [])
        return ParsedOutput(None, [ParsedCall(self.new_call_id(), c.name or "", c.arguments) for c in calls])


class NamedParser(ToolParser):
    """Every character the model writes is an argument fragment of the one named call."""

    name: ClassVar[str] = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return Snapshot("", [CallSoFar(self.function, text, final)])
