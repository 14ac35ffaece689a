"""The official ``anthropic`` client against a real engine server: ``/v1/messages`` and its token count.

On the simulator (the k-th token is the k-th letter) for the shapes; on the real tiny model for a
tool round trip, whose forced ``tool_choice`` is grammar-constrained so its input always validates.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anthropic
import httpx
import pytest

from kvfleet.testing.tools import answered, tool_use

if TYPE_CHECKING:
    from conftest import LiveServer

RENDERED = "<s><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"  # the simulator's chat template
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer",
                   "minimum": 1, "maximum": 3}},
    "required": ["city", "days"],
}  # fmt: skip
TOOLS: Any = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]


@pytest.fixture
def client(fast_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=fast_server.url, api_key="unused", max_retries=0) as c:
        yield c


def test_a_message_answers_with_a_text_block_its_stop_reason_and_usage(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model="tiny", system="Be brief.", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        metadata={"user_id": "u1"}, extra_body={"temperature": 0.5, "top_k": 5, "top_p": 0.9},
    )  # fmt: skip
    assert (msg.type, msg.role, msg.model) == ("message", "assistant", "tiny")
    assert msg.id.startswith("msg_")
    assert [(b.type, b.text) for b in msg.content if b.type == "text"] == [("text", "abc")]
    assert (msg.stop_reason, msg.stop_sequence) == ("max_tokens", None)
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (len(RENDERED) - 2, 3)  # "<s>" is one token


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=10, stop_sequences=["d"]
    )
    assert [b.text for b in msg.content if b.type == "text"] == ["abc"]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "d")


def test_a_streamed_message_sends_anthropics_events_in_order(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="tiny", system=[{"type": "text", "text": "Be brief."}], max_tokens=3,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and kinds[-3:-1] == ["content_block_stop", "message_delta"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "abc"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert [b.text for b in final.content if b.type == "text"] == ["abc"]
    assert final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(RENDERED) - 2, 3)


def test_count_tokens_equals_the_prompt_tokens_the_message_reports(client: anthropic.Anthropic) -> None:
    ask: Any = {"model": "tiny", "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}
    counted = client.messages.count_tokens(**ask)
    assert counted.input_tokens == client.messages.create(**ask, max_tokens=1).usage.input_tokens


def test_bad_input_is_a_400_in_anthropics_error_shape_naming_the_field(fast_server: LiveServer) -> None:
    with httpx.Client(base_url=fast_server.url, timeout=10) as c:
        missing = c.post(
            "/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
        )
        bad_temp = c.post(
            "/v1/messages",
            json={"model": "tiny", "max_tokens": 2, "temperature": 9,
                  "messages": [{"role": "user", "content": "x"}]},
        )  # fmt: skip
        unknown_model = c.post(
            "/v1/messages/count_tokens",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        )
    assert missing.status_code == 400
    assert missing.json() == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: field required"}
    }  # fmt: skip
    assert bad_temp.status_code == 400 and bad_temp.json()["error"]["message"].startswith("temperature: ")
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["type"] == "not_found_error"


def test_the_sdk_raises_its_own_error_for_a_tool_use_block_in_a_user_turn(
    client: anthropic.Anthropic,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="tiny", max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
        )  # fmt: skip
    assert err.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error",
                  "message": "messages.0: a tool_use block belongs to an assistant message, not a user one"},
    }  # fmt: skip


def test_a_tool_round_trip_calls_the_named_tool_then_answers_from_its_result(
    long_tiny_server: LiveServer,
) -> None:
    with anthropic.Anthropic(base_url=long_tiny_server.url, api_key="unused", max_retries=0) as client:
        question: Any = [{"role": "user", "content": "Weather in Paris?"}]
        ask: Any = {"model": "tiny", "max_tokens": 150, "tools": TOOLS, "extra_body": {"temperature": 0}}
        called = client.messages.create(
            **ask, messages=question, tool_choice={"type": "tool", "name": "get_weather"}
        )
        assert called.stop_reason == "tool_use"
        use = tool_use(called, WEATHER)
        assert use.name == "get_weather"
        with client.messages.stream(
            **ask, messages=question, tool_choice={"type": "any", "disable_parallel_tool_use": True}
        ) as stream:
            kinds = [e.type for e in stream]
            streamed = stream.get_final_message()
        assert "input_json" in kinds and streamed.stop_reason == "tool_use"
        tool_use(streamed, WEATHER)
        history = answered(question, called, use, "Sunny, 21 C")
        answer = client.messages.create(**ask, messages=history, tool_choice={"type": "none"})
        counted = client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
    assert answer.usage.input_tokens == counted.input_tokens > called.usage.input_tokens


def test_a_core_that_dies_mid_stream_ends_it_with_anthropics_error_event(slow_server: LiveServer) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 100,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    with slow_server.client() as c, c.stream("POST", "/v1/messages", json=body) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: message_start"
        pid = slow_server.state.engine.core.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line]
    assert rest[-2] == "event: error" and "data: [DONE]" not in rest
    error = json.loads(rest[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
