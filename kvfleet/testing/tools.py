"""The weather tool that the tool-calling tests ask real models to call, and the Anthropic round trip's steps.

Where it sits: test data beside :mod:`kvfleet.testing.json_schemas`. The engine's tool-calling
tests through the chat API and the Responses API ask SmolLM2 the same question with the same
parameters (:data:`WEATHER_PARAMETERS`, :data:`WEATHER_QUESTION`); the Anthropic Messages tests,
on the engine and through the router, read a forced ``tool_use`` (:func:`tool_use`) and send its
result back (:func:`answered`).
"""

from __future__ import annotations

from typing import Any

import jsonschema

# Bounded, so that a grammar-constrained call always ends within a small token budget.
WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER_QUESTION = "What is the weather in Paris, in celsius?"


def tool_use(message: Any, schema: dict[str, Any]) -> Any:
    """An Anthropic message's one ``tool_use`` block, its input valid under ``schema``."""
    (use,) = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(use.input, schema)
    return use


def answered(question: list[Any], called: Any, use: Any, content: str) -> list[Any]:
    """The conversation after ``called`` with ``use``'s result, ``content``, sent back as the user's turn."""
    result = {"type": "tool_result", "tool_use_id": use.id, "content": content}
    return [
        *question,
        {"role": "assistant", "content": called.content},
        {"role": "user", "content": [result]},
    ]
