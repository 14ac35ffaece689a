"""What the router sends the engine: the client's bytes, re-encoded only to ask for usage."""

from __future__ import annotations

import json

import pytest

from kvfleet.router.errors import RouterError
from kvfleet.router.requests import CHAT, COMPLETIONS, EMBEDDINGS, parse_request


def test_a_plain_request_is_forwarded_byte_for_byte() -> None:
    raw = b'{"model": "tiny",   "prompt": "hi", "max_tokens": 3, "user": "u-1"}'
    assert parse_request(COMPLETIONS, raw, 256).upstream_content() is raw


def test_a_field_no_part_of_kvfleet_implements_is_refused_before_it_is_forwarded() -> None:
    with pytest.raises(RouterError) as info:
        parse_request(COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "x_vendor": 1}', 256)
    assert (info.value.status, info.value.param) == (400, "x_vendor")
    assert info.value.message == "x_vendor: not a field this server knows; remove it"


def test_text_parts_are_joined_by_newlines_in_the_prompt_the_router_hashes() -> None:
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]}'
    assert parse_request(CHAT, raw, 256).prompt == "user\nhi\nthere\n"


def test_a_stream_that_already_asks_for_usage_is_forwarded_byte_for_byte() -> None:
    raw = b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}'
    assert parse_request(CHAT, raw, 256).upstream_content() is raw


def test_a_stream_without_usage_gets_include_usage_added_and_nothing_else_changed() -> None:
    raw = b'{"model":"tiny","prompt":"hi","stream":true,"max_tokens":2}'
    sent = json.loads(parse_request(COMPLETIONS, raw, 256).upstream_content())
    assert sent == {"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 2,
                    "stream_options": {"include_usage": True}}  # fmt: skip


def test_a_body_that_is_not_json_is_a_400_naming_it() -> None:
    with pytest.raises(RouterError) as info:
        parse_request(COMPLETIONS, b'{"model": "tiny", ', 256)
    assert info.value.status == 400 and "not valid JSON" in info.value.message


def test_a_structured_output_request_is_forwarded_as_sent_and_its_schema_is_not_counted_as_prompt() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    constrained = body | {
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    }
    raw = json.dumps(constrained).encode()
    parsed, plain = parse_request(CHAT, raw, 256), parse_request(CHAT, json.dumps(body).encode(), 256)
    assert parsed.upstream_content() is raw
    assert (parsed.prompt, parsed.max_tokens) == (plain.prompt, plain.max_tokens) == ("user\nhi\n", 9)
    assert parsed.prompt_tokens_estimate(4.0) == plain.prompt_tokens_estimate(4.0) == 2
    guided = parse_request(
        COMPLETIONS, b'{"model": "tiny", "prompt": "hi", "guided_choice": ["a", "b"]}', 256
    )
    assert guided.prompt_tokens_estimate(4.0) == 1


def test_a_tool_call_request_is_forwarded_as_sent_and_its_tools_are_not_counted_as_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    with_tools = body | {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    raw = json.dumps(with_tools).encode()
    parsed, plain = parse_request(CHAT, raw, 256), parse_request(CHAT, json.dumps(body).encode(), 256)
    assert parsed.upstream_content() is raw
    assert parsed.prompt_tokens_estimate(4.0) == plain.prompt_tokens_estimate(4.0) == 2


def test_a_named_tool_choice_that_names_no_tool_is_refused_naming_the_field() -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}},
    }
    with pytest.raises(RouterError) as info:
        parse_request(CHAT, json.dumps(body).encode(), 256)
    assert (info.value.status, info.value.param) == (400, "tool_choice")


def test_an_embeddings_request_is_forwarded_byte_for_byte_and_charged_no_completion() -> None:
    raw = b'{"model": "tiny",  "input": ["hi", "there"], "encoding_format": "base64", "dimensions": 8}'
    req = parse_request(EMBEDDINGS, raw, 256)
    assert req.upstream_content() is raw
    assert (req.max_tokens, req.stream, req.client_wants_usage, req.prompt) == (0, False, False, "hithere")


def test_an_embeddings_request_gets_no_cache_salt_from_its_tenant() -> None:
    from types import SimpleNamespace

    from kvfleet.router.pipeline import salted

    req = parse_request(EMBEDDINGS, b'{"model": "tiny", "input": "hi"}', 256)
    tenant = SimpleNamespace(name="alice")  # a pooling engine keeps no KV cache: nothing to partition
    assert salted(SimpleNamespace(), tenant, req).upstream_content() is req.raw  # type: ignore[arg-type]


def test_reasoning_fields_are_forwarded_byte_for_byte() -> None:
    # chat_template_kwargs (Qwen3's enable_thinking), include_reasoning, gpt-oss's reasoning_effort, and an
    # assistant turn's reasoning sent back: the engine reads them, the router passes them through unchanged
    body = {
        "model": "tiny", "max_tokens": 9, "chat_template_kwargs": {"enable_thinking": False},
        "include_reasoning": False, "reasoning_effort": "low",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "r"},
                     {"role": "user", "content": "and?"}],
    }  # fmt: skip
    raw = json.dumps(body).encode()
    assert parse_request(CHAT, raw, 256).upstream_content() is raw


def test_a_bad_enable_thinking_is_refused_at_the_router_naming_the_field() -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": 1},
    }
    with pytest.raises(RouterError) as info:
        parse_request(CHAT, json.dumps(body).encode(), 256)
    assert (info.value.status, info.value.param) == (400, "chat_template_kwargs")
    assert info.value.message == "chat_template_kwargs: enable_thinking: must be a boolean, not int"
