"""The Messages request as the chat request the engine serves: blocks, tools and tool choices map one to one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.anthropic_api import CountTokensRequest, MessagesRequest
from kvfleet.openai_api import APIError, NamedToolChoice, validate_request

TOOL: Any = {"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}


def _message(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    return validate_request(MessagesRequest, body)


def test_a_tool_round_trips_history_becomes_assistant_tool_calls_then_tool_messages() -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}
    chat = _message(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, use]},
            {"role": "user", "content": [result, {"type": "text", "text": "and tomorrow?"}]},
        ],
        tools=[TOOL],
    ).chat_request()
    dicts = chat.message_dicts()
    assert [m["role"] for m in dicts] == ["system", "user", "assistant", "tool", "user"]
    assert dicts[2]["content"] == "Let me look."
    assert dicts[2]["tool_calls"] == [
        {
            "id": "toolu_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert (dicts[3]["tool_call_id"], dicts[3]["content"]) == ("toolu_1", "sunny")
    assert dicts[4]["content"] == "and tomorrow?"
    assert chat.tools is not None and chat.tools[0].function.parameters == {"type": "object"}


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", None),
    ],
)
def test_each_tool_choice_maps_to_the_chat_one(choice: Any, expected: str, parallel: bool | None) -> None:
    chat = _message(tools=[TOOL], tool_choice=choice).chat_request()
    assert (chat.tool_choice, chat.parallel_tool_calls) == (expected, parallel)


def test_a_named_tool_choice_is_the_chat_named_function() -> None:
    chat = _message(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}).chat_request()
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "get_weather"


def test_sampling_fields_and_stop_sequences_carry_over_and_absent_ones_stay_unset() -> None:
    chat = _message(
        temperature=0.3, top_k=4, stop_sequences=["\n\n"], metadata={"user_id": "u"}
    ).chat_request()
    assert (chat.temperature, chat.top_k, chat.top_p, chat.stop, chat.max_tokens) == (
        0.3,
        4,
        None,
        ["\n\n"],
        8,
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"tool_choice": {"type": "any"}}, "tool_choice: needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice: the tool 'other' is not in tools"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
         "messages.0: a tool_result block belongs to a user message"),
        ({"temperature": 3}, "temperature: Input should be less than or equal to 2"),
    ],
)  # fmt: skip
def test_bad_messages_are_400s_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(APIError) as err:
        _message(**fields)
    assert err.value.status_code == 400 and err.value.message.startswith(message)


def test_count_tokens_needs_no_max_tokens_and_renders_the_same_chat() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}
    counted = validate_request(CountTokensRequest, body).chat_request()
    assert json.dumps(counted.message_dicts()) == json.dumps(
        _message(tools=[TOOL]).chat_request().message_dicts()
    )
