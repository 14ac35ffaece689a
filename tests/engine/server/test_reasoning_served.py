"""Reasoning and Harmony served to the official clients: the real tiny model, its output steered by a regex.

Two servers on copies of the tiny checkpoint: one with a Qwen3-style chat template that honours
``enable_thinking`` and ``--reasoning-parser qwen3``; one whose tokenizer ships no template,
served as gpt-oss is (``--reasoning-parser openai_gptoss --tool-call-parser openai``), so the
prompt is kvfleet's Harmony. A ``structured_outputs.regex`` that matches one exact text makes
the model write it, token by token, as a real model writes its reasoning, answer or call.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anthropic
import openai
import pytest

if TYPE_CHECKING:
    from conftest import LiveServer

ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ANALYSIS = "<|channel|>analysis<|message|>User wants weather. Use the tool.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 18 C in Paris.<|return|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


def forced(text: str) -> dict[str, Any]:
    """``extra_body`` that makes the model write exactly ``text`` (each character a one-character class,
    a newline ``\\n``)."""
    assert not set(text) & set("\\]^-")
    escaped = "".join(c if c.isalnum() else "\\n" if c == "\n" else f"[{c}]" for c in text)
    return {"structured_outputs": {"regex": escaped}}


def test_qwen3_returns_its_thinking_as_reasoning_content_apart_from_the_answer(
    qwen3_server: LiveServer,
) -> None:
    with qwen3_server.openai_client() as client:
        done = client.chat.completions.create(
            model="qwen3-tiny", messages=ASK, max_tokens=60, temperature=0,
            extra_body=forced("<think>\nCheck the sky.\n</think>\n\nSunny."),
        )  # fmt: skip
    message = done.choices[0].message
    assert (message.content, done.choices[0].finish_reason) == ("\n\nSunny.", "stop")  # as vLLM: unstripped
    assert message.model_extra == {
        "reasoning": "\nCheck the sky.\n",
        "reasoning_content": "\nCheck the sky.\n",
    }


def test_qwen3_streams_reasoning_deltas_before_the_content_deltas(qwen3_server: LiveServer) -> None:
    reasoning, content, order = "", "", []
    with qwen3_server.openai_client() as client:
        stream = client.chat.completions.create(
            model="qwen3-tiny", messages=ASK, max_tokens=60, temperature=0, stream=True,
            extra_body=forced("<think>\nCheck the sky.\n</think>\n\nSunny."),
        )  # fmt: skip
        for chunk in stream:
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                reasoning += extra["reasoning_content"]
                order.append("reasoning")
            if delta.content:
                content += delta.content
                order.append("content")
    assert (reasoning, content) == ("\nCheck the sky.\n", "\n\nSunny.")
    assert order == sorted(order, key=lambda k: k == "content") and order.count("reasoning") > 1


def test_enable_thinking_false_reaches_the_template_and_the_output_is_all_content(
    qwen3_server: LiveServer,
) -> None:
    with qwen3_server.openai_client() as client:
        ask = {"model": "qwen3-tiny", "messages": ASK, "max_tokens": 20, "temperature": 0}
        thinking = client.chat.completions.create(**ask, extra_body=forced("Sunny."))
        plain = client.chat.completions.create(
            **ask, extra_body={**forced("Sunny."), "chat_template_kwargs": {"enable_thinking": False}}
        )
    assert thinking.usage is not None and plain.usage is not None
    assert plain.usage.prompt_tokens - thinking.usage.prompt_tokens == len("<think>\n\n</think>\n\n")
    assert (thinking.choices[0].message.content, thinking.choices[0].message.model_extra) == (
        None, {"reasoning": "Sunny.", "reasoning_content": "Sunny."},
    )  # fmt: skip
    assert (plain.choices[0].message.content, plain.choices[0].message.model_extra) == ("Sunny.", {})


def test_include_reasoning_false_drops_the_reasoning(qwen3_server: LiveServer) -> None:
    with qwen3_server.openai_client() as client:
        done = client.chat.completions.create(
            model="qwen3-tiny", messages=ASK, max_tokens=60, temperature=0,
            extra_body={**forced("<think>x</think>Sunny."), "include_reasoning": False},
        )  # fmt: skip
    assert (done.choices[0].message.content, done.choices[0].message.model_extra) == ("Sunny.", {})


def test_a_bad_enable_thinking_is_a_400_naming_the_field(qwen3_server: LiveServer) -> None:
    with qwen3_server.openai_client() as client, pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="qwen3-tiny",
            messages=ASK,
            max_tokens=5,
            extra_body={"chat_template_kwargs": {"enable_thinking": "no"}},
        )
    assert err.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    assert "enable_thinking: must be a boolean, not str" in err.value.body["message"]  # type: ignore[index]


def test_the_responses_api_and_the_messages_api_return_the_same_reasoning_as_chat(
    qwen3_server: LiveServer,
) -> None:
    # the tiny model's own greedy text never closes a <think>: all of it is reasoning
    with qwen3_server.openai_client() as client:
        chat = client.chat.completions.create(model="qwen3-tiny", messages=ASK, max_tokens=8, temperature=0)
        response = client.responses.create(model="qwen3-tiny", input=ASK, max_output_tokens=8, temperature=0)
    thought = (chat.choices[0].message.model_extra or {})["reasoning_content"]
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == thought
    with anthropic.Anthropic(base_url=qwen3_server.url, api_key="unused", max_retries=0) as claude:
        ask: Any = {"model": "qwen3-tiny", "messages": ASK, "max_tokens": 8, "extra_body": {"temperature": 0}}
        message = claude.messages.create(**ask)
        plain = claude.messages.create(**ask, thinking={"type": "disabled"})
    assert message.content[0].type == "thinking" and message.content[0].thinking == thought
    assert [b.type for b in plain.content] == ["text"]


def test_gpt_oss_harmony_analysis_is_reasoning_and_final_is_content(gptoss_server: LiveServer) -> None:
    with gptoss_server.openai_client() as client:
        done = client.chat.completions.create(
            model="gpt-oss-tiny",
            messages=ASK,
            max_tokens=200,
            temperature=0,
            extra_body=forced(ANALYSIS + FINAL),
        )
    message = done.choices[0].message
    assert message.content == "It is 18 C in Paris."
    assert (message.model_extra or {})["reasoning_content"] == "User wants weather. Use the tool."


def test_gpt_oss_calls_a_tool_in_commentary_and_reads_its_result_back(gptoss_server: LiveServer) -> None:
    with gptoss_server.openai_client() as client:
        ask: Any = {"model": "gpt-oss-tiny", "tools": [WEATHER], "max_tokens": 250, "temperature": 0}
        called = client.chat.completions.create(**ask, messages=ASK, extra_body=forced(ANALYSIS + CALL))
        choice = called.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
        call = choice.message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert (choice.message.model_extra or {})["reasoning_content"] == "User wants weather. Use the tool."
        history: Any = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()],
             "reasoning_content": "User wants weather. Use the tool."},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
        ]  # fmt: skip
        final = client.chat.completions.create(
            **ask, messages=history, extra_body=forced(FINAL[len("<|start|>assistant") :])
        )
    assert final.choices[0].message.content == "It is 18 C in Paris."
    assert final.usage is not None and final.usage.prompt_tokens > called.usage.prompt_tokens  # type: ignore[union-attr]


def test_gpt_oss_streams_reasoning_then_the_call_id_name_and_arguments(gptoss_server: LiveServer) -> None:
    reasoning, names, arguments, finish = "", [], "", None
    with gptoss_server.openai_client() as client:
        stream = client.chat.completions.create(
            model="gpt-oss-tiny", messages=ASK, tools=[WEATHER], max_tokens=250, temperature=0, stream=True,
            extra_body=forced(ANALYSIS + CALL),
        )  # fmt: skip
        for chunk in stream:
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for d in choice.delta.tool_calls or []:
                assert reasoning == "User wants weather. Use the tool.", (
                    "a call delta came before the reasoning"
                )
                names += [d.function.name] if d.id else []
                arguments += d.function.arguments or "" if d.function else ""
    assert (names, json.loads(arguments), finish) == (["get_weather"], {"city": "Paris"}, "tool_calls")


def test_streamed_responses_and_messages_send_the_reasoning_first(qwen3_server: LiveServer) -> None:
    with qwen3_server.openai_client() as client:
        chat = client.chat.completions.create(model="qwen3-tiny", messages=ASK, max_tokens=8, temperature=0)
        thought = (chat.choices[0].message.model_extra or {})["reasoning_content"]
        with client.responses.stream(
            model="qwen3-tiny", input=ASK, max_output_tokens=8, temperature=0
        ) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    deltas = [k for k in kinds if k == "response.reasoning_text.delta"]
    assert deltas and kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.done")
    assert final.output[0].type == "reasoning" and final.output[0].content is not None
    assert final.output[0].content[0].text == thought
    with anthropic.Anthropic(base_url=qwen3_server.url, api_key="unused", max_retries=0) as claude:
        ask: Any = {"model": "qwen3-tiny", "messages": ASK, "max_tokens": 8, "extra_body": {"temperature": 0}}
        with claude.messages.stream(**ask) as events:
            message = events.get_final_message()
    assert message.content[0].type == "thinking" and message.content[0].thinking == thought


def test_tokenize_counts_the_prompt_the_completion_reports_harmony_and_template_kwargs_included(
    gptoss_server: LiveServer, qwen3_server: LiveServer
) -> None:
    for server, model, kwargs in ((gptoss_server, "gpt-oss-tiny", {}),
                                  (qwen3_server, "qwen3-tiny", {"enable_thinking": False})):  # fmt: skip
        with server.openai_client() as client, server.client() as http:
            done = client.chat.completions.create(
                model=model, messages=ASK, max_tokens=2, extra_body={"chat_template_kwargs": kwargs}
            )
            counted = http.post(
                "/tokenize", json={"model": model, "messages": ASK, "chat_template_kwargs": kwargs}
            )
        assert done.usage is not None and counted.json()["count"] == done.usage.prompt_tokens


def test_a_bad_anthropic_thinking_setting_is_a_400_naming_the_field(qwen3_server: LiveServer) -> None:
    claude = anthropic.Anthropic(base_url=qwen3_server.url, api_key="unused", max_retries=0)
    with claude, pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(
            model="qwen3-tiny", messages=ASK, max_tokens=4, extra_body={"thinking": {"type": "sometimes"}}
        )
    assert err.value.body["error"]["message"].startswith("thinking.type: Input should be")  # type: ignore[index]
