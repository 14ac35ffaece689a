"""The Harmony kvfleet renders for a gpt-oss tokenizer without a chat template: the text gpt-oss's template
writes (system, developer with instructions and tools, the turns, a tool call and its result)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvfleet.engine.server.harmony import read_messages, render_conversation

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["C", "F"], "default": "C"},
            },
            "required": ["city"],
        },
    },
}


def system(effort: str = "medium", tools: bool = False) -> str:
    calls = "\nCalls to these tools must go to the commentary channel: 'functions'." if tools else ""
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {time.strftime('%Y-%m-%d')}\n\nReasoning: {effort}\n\n"
        f"# Valid channels: analysis, commentary, final. Channel must be included for every message.{calls}<|end|>"
    )


def test_a_plain_chat_is_system_user_and_the_assistants_turn() -> None:
    text = render_conversation([{"role": "user", "content": "Hi"}], kwargs={"reasoning_effort": "low"})
    assert text == system("low") + "<|start|>user<|message|>Hi<|end|><|start|>assistant"


def test_the_system_message_becomes_the_developers_instructions_with_the_tools() -> None:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    text = render_conversation(chat, [WEATHER])
    assert text == system(tools=True) + (
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// The weather in a city\ntype get_weather = (_: {\n// The city\ncity: string,\n"
        'unit?: "C" | "F", // default: C,\n}) => any;\n\n} // namespace functions<|end|>'
        "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
    )


def test_a_tool_call_and_its_result_are_commentary_to_and_from_the_function() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    chat = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "Use the tool."},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    assert render_conversation(chat, [WEATHER]).endswith(
        "<|start|>user<|message|>Weather?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C"<|end|>'
        "<|start|>assistant"
    )


def test_reasoning_of_a_turn_a_later_answer_followed_is_dropped() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
    chat = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "think"},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Q2"},
    ]
    text = render_conversation(chat)
    assert (
        "<|channel|>analysis" not in text and "<|start|>assistant<|channel|>final<|message|>A<|end|>" in text
    )


def test_a_tool_result_without_a_call_before_it_is_refused() -> None:
    with pytest.raises(ValueError, match="a tool message follows no assistant tool call"):
        render_conversation([{"role": "tool", "content": "r"}])


def test_what_it_renders_for_the_assistant_reads_back_as_the_same_messages() -> None:
    text = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>"
    assert [(m.channel, m.text, m.complete) for m in read_messages(text, final=False)] == [
        ("analysis", "a", True),
        ("final", "b", True),
    ]
