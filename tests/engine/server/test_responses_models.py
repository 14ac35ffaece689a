"""The Responses API on real models through the official ``openai`` client: ``text.format`` json_schema
(the SDK's ``responses.parse``) on tiny and SmolLM2, and a function call round trip on SmolLM2: the call,
its ``function_call_output`` sent back, then the model's answer in text, whole and streamed."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from kvfleet.testing.tools import WEATHER_PARAMETERS, WEATHER_QUESTION

if TYPE_CHECKING:
    from conftest import LiveServer

TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "The current weather in a city",
     "parameters": WEATHER_PARAMETERS},
]  # fmt: skip
NAMED: Any = {"type": "function", "name": "get_weather"}


class Person(BaseModel):
    name: str
    age: int


def test_text_format_json_schema_gives_json_that_validates(tiny_server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    fmt: Any = {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}
    with tiny_server.openai_client() as client:
        done = client.responses.create(model="tiny", input="x", text=fmt, max_output_tokens=40)
    assert done.status == "completed"
    jsonschema.validate(json.loads(done.output_text), schema)
    assert done.text is not None and done.text.format is not None and done.text.format.type == "json_schema"


def test_the_openai_client_parses_a_pydantic_model_from_smollm2(smollm2_server: LiveServer) -> None:
    with smollm2_server.openai_client() as client:
        done = client.responses.parse(
            model="smollm2",
            input="Alice is 30 years old. Give her name and age as JSON.",
            text_format=Person,
            max_output_tokens=40,
            temperature=0,
        )
    assert done.output_parsed == Person(name="Alice", age=30)


def _answer(client: openai.OpenAI, first: Any, call: Any) -> str:
    """The tool's result goes back as a ``function_call_output`` after the stored call; the model answers."""
    result: Any = {"type": "function_call_output", "call_id": call.call_id,
                   "output": '{"temperature": 18, "sky": "sunny"}'}  # fmt: skip
    then: Any = {"model": "smollm2", "tools": TOOLS, "tool_choice": "none", "max_output_tokens": 24,
                 "temperature": 0}  # fmt: skip
    answer = client.responses.create(**then, previous_response_id=first.id, input=[result])
    assert not [i for i in answer.output if i.type == "function_call"]
    assert (
        answer.usage is not None and answer.usage.input_tokens > 60
    )  # the call and its result were rendered
    assert answer.output_text
    # The same conversation sent whole, without the store, is the same prompt.
    sent_call = {
        "type": "function_call",
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments,
    }
    whole: Any = [{"role": "user", "content": WEATHER_QUESTION}, sent_call, result]
    resent = client.responses.create(**then, input=whole, store=False)
    assert resent.output_text == answer.output_text
    return answer.output_text


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_function_call_round_trip_whole(smollm2_server: LiveServer, tool_choice: Any) -> None:
    with smollm2_server.openai_client() as client:
        first = client.responses.create(
            model="smollm2", input=WEATHER_QUESTION, tools=TOOLS, tool_choice=tool_choice, max_output_tokens=60,
            temperature=0,
        )  # fmt: skip
        calls = [i for i in first.output if i.type == "function_call"]
        assert len(calls) >= 1
        call = calls[0]
        assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
        _answer(client, first, call)


def test_a_function_call_round_trip_streamed(smollm2_server: LiveServer) -> None:
    with smollm2_server.openai_client() as client:
        with client.responses.stream(
            model="smollm2",
            input=WEATHER_QUESTION,
            tools=TOOLS,
            tool_choice=NAMED,
            max_output_tokens=60,
            temperature=0,
        ) as stream:
            events = list(stream)
            first = stream.get_final_response()
        kinds = [e.type for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]  # fmt: skip
        assert kinds.count("response.function_call_arguments.delta") >= 1
        assert [e.sequence_number for e in events] == list(range(len(events)))
        [call] = [i for i in first.output if i.type == "function_call"]
        streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert streamed == call.arguments
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
        _answer(client, first, call)
