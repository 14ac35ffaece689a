"""The shared OpenAI wire format: what parses, and the exact 400 each bad body gets."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfleet.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    error_body,
    model_not_found,
    parse_request,
    validate_request,
)


def _error(model: type, body: Any) -> dict[str, Any]:
    with pytest.raises(APIError) as info:
        validate_request(model, body)
    assert info.value.status_code == 400
    return info.value.body()["error"]


def test_a_completion_request_keeps_every_standard_field() -> None:
    req = validate_request(
        CompletionRequest,
        {
            "model": "tiny",
            "prompt": "Hello",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "n": 2,
            "stop": "\n",
            "seed": 7,
            "logprobs": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u1",
            "priority": -1,
        },
    )
    assert (req.max_tokens, req.temperature, req.top_p, req.n, req.seed, req.logprobs) == (
        5,
        0.0,
        0.5,
        2,
        7,
        3,
    )
    assert req.stop_list == ["\n"]
    assert req.include_usage is True
    assert req.prompts() == ["Hello"]
    assert req.priority == -1


def test_prompts_come_as_strings_or_token_id_lists() -> None:
    def prompts(p: Any) -> list[Any]:
        return validate_request(CompletionRequest, {"model": "m", "prompt": p}).prompts()

    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1, 2], [3]]) == [[1, 2], [3]]


def test_a_prompt_of_the_wrong_shape_gets_one_message_naming_the_prompt() -> None:
    for bad in (5, [], [1, "a"], [[1], []], [-1], None):
        err = _error(CompletionRequest, {"model": "m", "prompt": bad})
        assert err["param"] == "prompt"
        assert err["message"].startswith("prompt: must be a string, a list of strings")


def test_a_missing_field_is_named() -> None:
    assert _error(CompletionRequest, {"prompt": "x"}) == {
        "message": "model: field required",
        "type": "invalid_request_error",
        "param": "model",
        "code": None,
    }
    assert _error(ChatCompletionRequest, {"model": "m"})["message"] == "messages: field required"


def test_negative_and_huge_max_tokens_are_rejected_with_the_limit() -> None:
    err = _error(CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": -1})
    assert err["message"] == "max_tokens: Input should be greater than or equal to 1 (got -1)"
    err = _error(CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": 1 << 40})
    assert err["message"] == f"max_tokens: Input should be less than or equal to {1 << 31} (got {1 << 40})"


def test_wrong_types_are_rejected_not_coerced() -> None:
    assert _error(CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": "5"})["message"] == (
        "max_tokens: Input should be a valid integer (got '5')"
    )
    assert _error(CompletionRequest, {"model": "m", "prompt": "x", "stream": "yes"})["param"] == "stream"
    assert _error(CompletionRequest, {"model": "m", "prompt": "x", "stop": [5]})["param"] == "stop.0"


def test_ranges_of_the_sampling_fields_are_checked() -> None:
    base = {"model": "m", "prompt": "x"}
    assert _error(CompletionRequest, base | {"temperature": 2.5})["param"] == "temperature"
    assert _error(CompletionRequest, base | {"top_p": 0})["param"] == "top_p"
    assert _error(CompletionRequest, base | {"n": 0})["param"] == "n"
    assert _error(CompletionRequest, base | {"logprobs": 21})["param"] == "logprobs"
    assert _error(CompletionRequest, base | {"top_k": 0})["message"] == (
        "top_k: must be at least 1, or -1/null for no cut, got 0"
    )
    assert _error(CompletionRequest, base | {"stop": ["a", ""]})["message"] == (
        "stop: stop sequences must be non-empty strings"
    )


def test_penalties_and_logit_bias_are_read_and_their_ranges_named() -> None:
    base = {"model": "m", "prompt": "x"}
    req = validate_request(
        CompletionRequest,
        base
        | {
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "logit_bias": {"5": 100, "17": -3.5},
            "include_stop_str_in_output": True,
        },
    )
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.5, -1, 1.2)
    assert req.logit_bias_ids == {5: 100, 17: -3.5}
    assert req.include_stop_str_in_output
    assert _error(CompletionRequest, base | {"frequency_penalty": 2.5})["param"] == "frequency_penalty"
    assert _error(CompletionRequest, base | {"repetition_penalty": 0})["param"] == "repetition_penalty"
    err = _error(CompletionRequest, base | {"logit_bias": {"abc": 1}})
    assert (err["param"], err["message"]) == (
        "logit_bias",
        "logit_bias: keys must be token ids (integers >= 0 as strings), got 'abc'",
    )
    err = _error(CompletionRequest, base | {"logit_bias": {"3": 101}})
    assert err["message"] == "logit_bias: biases must be in [-100, 100], got 101.0 for token 3"


def test_min_tokens_over_max_tokens_is_a_400_not_a_clamp() -> None:
    err = _error(CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": 4, "min_tokens": 5})
    assert (err["param"], err["message"]) == (
        "min_tokens",
        "min_tokens: must be at most max_tokens (4), got 5",
    )
    msgs = [{"role": "user", "content": "x"}]
    body = {"model": "m", "messages": msgs, "max_completion_tokens": 2, "min_tokens": 3}
    assert _error(ChatCompletionRequest, body)["param"] == "min_tokens"


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type", "Input should be 'text', 'json_object' or 'json_schema'"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required when type is 'json_schema'"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.name", "field required"),
        ({"functions": [{"name": "f"}]}, "functions", "function calling is not implemented; remove it"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "whitespace pattern for guided decoding is not implemented"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "only 'auto' or 'xgrammar' is implemented"),
        ({"use_beam_search": True}, "use_beam_search", "beam search is not implemented"),
        ({"frobnicate": 1}, "frobnicate", "frobnicate: not a field this server knows; remove it"),
    ],
)  # fmt: skip
def test_fields_kvfleet_does_not_implement_are_refused_naming_the_field(
    extra: dict[str, Any], param: str, message: str
) -> None:
    for model, base in (
        (CompletionRequest, {"model": "m", "prompt": "x"}),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    ):
        err = _error(model, base | extra)
        assert err["param"] == param
        assert message in err["message"]


def test_the_harmless_forms_of_unimplemented_fields_are_accepted() -> None:
    body = {"model": "m", "prompt": "x", "n": 2, "best_of": 2, "echo": False, "suffix": None}
    body |= {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}
    assert validate_request(CompletionRequest, body).n == 2
    err = _error(CompletionRequest, body | {"best_of": 3})
    assert (err["param"], err["message"]) == (
        "best_of",
        "best_of: only best_of equal to n (2) is implemented (it ranks no extra samples), got 3",
    )
    assert _error(CompletionRequest, body | {"echo": True})["param"] == "echo"
    assert _error(CompletionRequest, body | {"suffix": "x"})["param"] == "suffix"


def test_unknown_fields_inside_messages_and_stream_options_are_refused() -> None:
    msgs = [{"role": "user", "content": "x", "audio": {}}]
    assert _error(ChatCompletionRequest, {"model": "m", "messages": msgs})["param"] == "messages.0.audio"
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}}
    assert _error(CompletionRequest, body)["param"] == "stream_options.x"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "a\ud800b"}, "prompt"),
        ({"model": "m", "prompt": ["ok", "\udfff"]}, "prompt.1"),
        ({"model": "m\ud800", "prompt": "x"}, "model"),
        ({"model": "m", "prompt": "x", "stop": ["\udc00"]}, "stop.0"),
        ({"model": "m", "prompt": "x", "logit_bias": {"\ud800": 1}}, "logit_bias"),
    ],
)
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(body: dict[str, Any], param: str) -> None:
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a \\u escape
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, raw)
    assert (info.value.status_code, info.value.param) == (400, param)
    assert "lone UTF-16 surrogate" in info.value.message


def test_a_lone_surrogate_in_a_chat_message_is_a_400() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}'
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, raw)
    assert info.value.param == "messages.0.content.0.text"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "\xff"}',
        b'{"model": "m", "prompt": "\xc0\xaf"}',
        b'{"model": "m", "prompt": "\xed\xa0\x80"}',
    ],
    ids=["invalid-byte", "overlong", "encoded-surrogate"],
)
def test_invalid_utf8_is_a_400(raw: bytes) -> None:
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, raw)
    assert info.value.status_code == 400
    assert "not valid UTF-8" in info.value.message


def test_empty_prompts_are_refused() -> None:
    assert _error(CompletionRequest, {"model": "m", "prompt": ""})["message"] == "prompt: the prompt is empty"
    assert (
        _error(CompletionRequest, {"model": "m", "prompt": ["a", ""]})["message"]
        == "prompt: prompt 1 is empty"
    )


def test_stream_options_without_stream_name_the_field() -> None:
    err = _error(CompletionRequest, {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}})
    assert (err["param"], err["message"]) == (
        "stream_options",
        "stream_options: only allowed when stream is true",
    )


def test_an_empty_message_list_is_rejected() -> None:
    err = _error(ChatCompletionRequest, {"model": "m", "messages": []})
    assert (err["param"], err["message"]) == ("messages", "messages: must contain at least one message")


def test_chat_content_may_be_text_parts_joined_by_newlines_but_not_images() -> None:
    req = validate_request(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
        },
    )
    assert req.message_dicts() == [{"role": "user", "content": "a\nb"}]  # as vLLM joins them
    err = _error(
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    )
    assert err["param"] == "messages.0.content.0.type"
    assert _error(ChatCompletionRequest, {"model": "m", "messages": [{"role": "bot", "content": "x"}]})[
        "param"
    ] == ("messages.0.role")


def test_chat_max_completion_tokens_wins_over_max_tokens_and_logprobs_need_the_flag() -> None:
    msgs = [{"role": "user", "content": "x"}]
    req = validate_request(
        ChatCompletionRequest, {"model": "m", "messages": msgs, "max_tokens": 9, "max_completion_tokens": 4}
    )
    assert req.requested_max_tokens == 4
    req = validate_request(
        ChatCompletionRequest, {"model": "m", "messages": msgs, "logprobs": True, "top_logprobs": 2}
    )
    assert req.num_logprobs == 2
    assert (
        _error(ChatCompletionRequest, {"model": "m", "messages": msgs, "top_logprobs": 2})["param"]
        == "top_logprobs"
    )


def test_malformed_json_and_non_objects_are_400s() -> None:
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, b'{"model": ')
    assert info.value.status_code == 400
    assert info.value.message.startswith("the request body is not valid JSON")
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, b"[1, 2]")
    assert info.value.message == "the request body must be a JSON object, got list"


def test_tokenize_takes_exactly_one_of_prompt_or_messages() -> None:
    assert validate_request(TokenizeRequest, {"prompt": "x"}).prompt == "x"
    assert _error(TokenizeRequest, {})["param"] == "prompt"


def test_the_error_body_has_openais_four_fields() -> None:
    assert error_body("no", param="x") == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "x", "code": None}
    }
    err = model_not_found("gpt-4", "tiny")
    assert (err.status_code, err.code, err.param) == (404, "model_not_found", "model")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice: needs tools (the functions the model may call)"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
         "tool_choice: the function 'f' is not in tools ['get_weather']"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "Input should be 'none', 'auto' or 'required'"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "field required"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "String should match pattern"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0",
         "tool_call_id: only tool messages answer a call, not 'user' ones"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_the_field(extra: dict[str, Any], param: str, message: str) -> None:
    err = _error(ChatCompletionRequest, {"model": "m", "messages": USER} | extra)
    assert (err["param"], message in err["message"]) == (param, True), err


def test_completions_refuse_tools_but_take_their_harmless_forms() -> None:
    base = {"model": "m", "prompt": "x"}
    err = _error(CompletionRequest, base | {"tools": [WEATHER]})
    assert (err["param"], err["message"]) == (
        "tools",
        "tools: only chat completions call tools (POST /v1/chat/completions)",
    )
    assert _error(CompletionRequest, base | {"tool_choice": "required"})["param"] == "tool_choice"
    assert validate_request(CompletionRequest, base | {"tools": [], "tool_choice": "none"}).tools == []


def test_tool_choice_defaults_to_auto_with_tools_and_history_keeps_calls_as_objects() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    msgs = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    msgs.append({"role": "tool", "tool_call_id": "c1", "content": "18C"})
    req = validate_request(ChatCompletionRequest, {"model": "m", "messages": msgs, "tools": [WEATHER]})
    assert (req.effective_tool_choice, req.parallel_tool_calls) == ("auto", None)
    assert req.message_dicts() == [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
    ]  # fmt: skip
    without = validate_request(ChatCompletionRequest, {"model": "m", "messages": USER})
    assert without.effective_tool_choice == "none"
