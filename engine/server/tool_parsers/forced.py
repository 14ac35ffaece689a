"""The parsers of forced tool choices, whose output a JSON schema constrains (not chosen by flag).

``tool_choice: "required"``: the output is a JSON array of ``{"name", "parameters"}`` objects
(the schema of :func:`kvfleet.engine.server.tool_calling.required_schema`). A named function:
the output is that function's arguments object and nothing else. Both are read directly as
JSON, as vLLM reads them, not by the model family's parser.
"""

from __future__ import annotations

from typing import ClassVar

from kvfleet.engine.server.tool_parsers.base import CallSoFar, Snapshot, ToolParser
from kvfleet.engine.server.tool_parsers.json_scan import skip_ws
from kvfleet.engine.server.tool_parsers.mistral import read_call_array


class RequiredParser(ToolParser):
    name: ClassVar[str] = "required"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_ws(text, 0)
        if start >= len(text) or text[start] != "[":
            return Snapshot("")
        return Snapshot("", read_call_array(text, start))


class NamedParser(ToolParser):
    """Every character the model writes is an argument fragment of the one named call."""

    name: ClassVar[str] = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return Snapshot("", [CallSoFar(self.function, text, final)])
