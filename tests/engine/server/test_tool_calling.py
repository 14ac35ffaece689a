"""Tool calling through the official ``openai`` client on real SmolLM2 (issue #28): a call, the tool's
result, then the final answer, with ``tool_choice="required"`` and with a named function, whole and
streamed. The forced choices are grammar-constrained, so the arguments always validate."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import openai
import pytest

from kvfleet.testing.tools import WEATHER_PARAMETERS, WEATHER_QUESTION

if TYPE_CHECKING:
    from conftest import LiveServer

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}},
        },
    },
]
QUESTION = [{"role": "user", "content": WEATHER_QUESTION}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def _check_call(name: str, arguments: str) -> None:
    assert name in {"get_weather", "get_time"}
    schema = WEATHER_PARAMETERS if name == "get_weather" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)


def _asking(tool_choice: Any) -> dict[str, Any]:
    """The question with the tools, greedy (SmolLM2-135M sampled at temperature 1 rambles in strings)."""
    return {"model": "smollm2", "messages": QUESTION, "tools": TOOLS, "tool_choice": tool_choice,
            "max_tokens": 60, "temperature": 0}  # fmt: skip


def _stream_call(client: openai.OpenAI, tool_choice: Any) -> tuple[str, str, str, str | None]:
    """The streamed call's (id, name, arguments, finish_reason), checking OpenAI's chunk order."""
    call_id, name, arguments, finish, fragments = "", "", "", None, 0
    stream = client.chat.completions.create(**_asking(tool_choice), stream=True)
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            if delta.id is not None:  # the first delta of a call: its id and name, before any argument
                assert not call_id and not arguments
                call_id, name = delta.id, delta.function.name
            elif delta.function and delta.function.arguments:
                assert call_id, "an argument fragment came before the call's id and name"
                arguments += delta.function.arguments
                fragments += 1
    assert fragments >= 1
    return call_id, name, arguments, finish


def _history(call_id: str, name: str, arguments: str, result: str) -> list[Any]:
    return [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


RESULT = '{"temperature": 18, "sky": "sunny"}'


def _final_answer(live: LiveServer, call_id: str, name: str, arguments: str) -> str | None:
    """The tool's result goes back through the chat template; the model answers in text, from a prompt
    that is exactly the history /tokenize renders, the result in it (and, with the tools and
    tool_choice none, a longer prompt that renders them too)."""
    history = _history(call_id, name, arguments, RESULT)
    with live.openai_client() as client:
        answer = client.chat.completions.create(
            model="smollm2", messages=history, max_tokens=24, temperature=0
        )
        with_tools = client.chat.completions.create(
            model="smollm2", messages=history, tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0
        )
    with httpx.Client(base_url=live.url, timeout=30) as c:
        rendered = c.post(
            "/tokenize", json={"model": "smollm2", "messages": history, "return_token_strs": True}
        )
    choice = answer.choices[0]
    assert choice.finish_reason in {"stop", "length"}
    assert not choice.message.tool_calls
    assert answer.usage is not None and answer.usage.prompt_tokens == rendered.json()["count"]
    assert f"<tool_response>\n{RESULT}\n</tool_response>" in "".join(rendered.json()["token_strs"])
    assert not with_tools.choices[0].message.tool_calls  # tool_choice none: text, the tools rendered
    assert with_tools.usage is not None and with_tools.usage.prompt_tokens > answer.usage.prompt_tokens
    return choice.message.content


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_tool_call_round_trip_whole(smollm2_server: LiveServer, tool_choice: Any) -> None:
    with smollm2_server.openai_client() as client:
        response = client.chat.completions.create(**_asking(tool_choice))
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert len(calls) >= 1
        call = calls[0]
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        if tool_choice == NAMED:
            assert call.function.name == "get_weather"
        _check_call(call.function.name, call.function.arguments)
        answer = _final_answer(smollm2_server, call.id, call.function.name, call.function.arguments)
        assert isinstance(answer, str) and answer


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_tool_call_round_trip_streamed(smollm2_server: LiveServer, tool_choice: Any) -> None:
    with smollm2_server.openai_client() as client:
        call_id, name, arguments, finish = _stream_call(client, tool_choice)
        assert finish == "tool_calls"
        assert call_id.startswith("chatcmpl-tool-")
        if tool_choice == NAMED:
            assert name == "get_weather"
        _check_call(name, arguments)
        answer = _final_answer(smollm2_server, call_id, name, arguments)
        assert isinstance(answer, str) and answer


def test_auto_tool_choice_without_the_flag_is_a_400_naming_it(smollm2_server: LiveServer) -> None:
    with smollm2_server.openai_client() as client, pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="auto")
    assert "--enable-auto-tool-choice" in str(err.value)


# SmolLM2 answers this with get_weather for Paris, then London, then Paris again, until max_tokens.
TWO_CITIES = [{"role": "user", "content": "Get the weather in Paris and in London, in celsius."}]
CUT_CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("get_weather", {"city": "London", "unit": "celsius"}),
]


def test_a_required_call_array_cut_at_max_tokens_returns_the_calls_that_closed_before_the_cut(
    smollm2_server: LiveServer,
) -> None:
    asking: Any = {"model": "smollm2", "messages": TWO_CITIES, "tools": TOOLS, "tool_choice": "required",
                   "max_tokens": 80, "temperature": 0}  # fmt: skip
    with smollm2_server.openai_client() as client:
        whole = client.chat.completions.create(**asking).choices[0]
        streamed: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(**asking, stream=True):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                assert not choice.delta.content  # the cut third call is not sent as text either
                for d in choice.delta.tool_calls or []:
                    call = streamed.setdefault(d.index, [d.id or "", ""])
                    call[1] += d.function.arguments if d.function and d.function.arguments else ""
                    if d.function and d.function.name:
                        call.append(d.function.name)
    assert whole.finish_reason == "length" and finish == "length"  # as vLLM: the engine's reason
    assert whole.message.content is None
    calls = whole.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CUT_CALLS
    assert len({c.id for c in calls}) == 2
    assert [(v[2], json.loads(v[1])) for _, v in sorted(streamed.items())] == CUT_CALLS
    assert len({v[0] for v in streamed.values()}) == 2


@pytest.mark.parametrize("celsius", [7, 18, 31])
def test_the_answer_reads_the_tool_result_in_the_history(smollm2_server: LiveServer, celsius: int) -> None:
    """SmolLM2 answers with the temperature the tool gave (greedy: "The weather in Paris, in Celsius,
    is 31."): a dropped or misrendered tool message cannot give three different right numbers."""
    call = '{"city": "Paris", "unit": "celsius"}'
    history = _history(
        "chatcmpl-tool-1", "get_weather", call, f'{{"temperature": {celsius}, "sky": "sunny"}}'
    )
    with smollm2_server.openai_client() as client:
        answer = client.chat.completions.create(
            model="smollm2", messages=history, max_tokens=30, temperature=0
        )
    assert re.findall(r"\d+", answer.choices[0].message.content or "") == [str(celsius)]
