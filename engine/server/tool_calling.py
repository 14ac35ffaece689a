"""What a chat request's ``tools`` and ``tool_choice`` make of it: the parser, the prompt's tools, the schema.

Where it sits: the chat route asks :func:`plan_tools` before it renders the prompt; the plan
says which tools the chat template gets, which parser reads the output and, for the forced
choices, the JSON schema the output is constrained to (:func:`constrain`). As vLLM serves it:

* ``none``: the tools are rendered, the output is text.
* ``auto``: the parser of ``--tool-call-parser`` reads the output; without
  ``--enable-auto-tool-choice`` the request is a 400 naming it.
* ``required``: the output is a JSON array of ``{"name", "parameters"}`` objects (at most one
  when ``parallel_tool_calls`` is false), read directly as JSON.
* a named function: the output is its arguments object.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputSpec
from kvfleet.engine.server.state import ToolSettings
from kvfleet.engine.server.structured_request import check_json_schema
from kvfleet.engine.server.tool_parsers import get_parser
from kvfleet.engine.server.tool_parsers.base import ToolParser
from kvfleet.engine.server.tool_parsers.forced import NamedParser, RequiredParser
from kvfleet.openai_api import APIError, ChatCompletionRequest, ChatTool, NamedToolChoice

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # what the chat template gets (None: no tools)
    parser: ToolParser | None  # None: the output is text
    schema: dict[str, Any] | None  # the forced choices' constraint


def plan_tools(req: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan:
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.effective_tool_choice
    if choice == "none" or not req.tools:
        return ToolPlan(tools, None, None)
    if choice == "auto":
        if not settings.auto or settings.parser is None:
            raise APIError(
                400,
                'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        return ToolPlan(tools, get_parser(settings.parser), None)
    if choice == "required":
        return ToolPlan(
            tools, RequiredParser(), required_schema(req.tools, req.parallel_tool_calls is not False)
        )
    assert isinstance(choice, NamedToolChoice)
    index, tool = next((i, t) for i, t in enumerate(req.tools) if t.function.name == choice.function.name)
    return ToolPlan(tools, NamedParser(tool.function.name), _parameters(index, tool))


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: required``: a non-empty array of calls of the given tools."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": _parameters(i, t),
                    },
                    "required": ["name", "parameters"],
                }
                for i, t in enumerate(tools)
            ],
        },
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _parameters(index: int, tool: ChatTool) -> dict[str, Any]:
    params = tool.function.parameters
    return NO_ARGUMENTS if not params else check_json_schema(f"tools.{index}.function.parameters", params)


def constrain(plan: ToolPlan, params: SamplingParams) -> SamplingParams:
    """The params with the plan's schema (a forced choice besides another constraint is a 400) and the
    parser's special-token handling."""
    if plan.schema is not None:
        if params.structured is not None:
            raise APIError(
                400,
                f"tool_choice: a required or named tool choice constrains the output itself; it cannot be "
                f"combined with {params.structured.param}",
                param="tool_choice",
            )
        text = json.dumps(plan.schema, separators=(",", ":"), sort_keys=True)
        params = dataclasses.replace(
            params, structured=StructuredOutputSpec("json", text, source="tool_choice")
        )
    if plan.parser is not None and not plan.parser.skip_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params
