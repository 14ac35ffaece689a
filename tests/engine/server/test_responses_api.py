"""The Responses API (``POST /v1/responses``) through the official ``openai`` client: the simulator's
k-th token is the k-th letter, so every text is known; structured outputs and tools run on real models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from conftest import LiveServer


def _assert_prompt_of_chat(client: openai.OpenAI, done: Any, messages: Any) -> None:
    """``done``'s prompt is, token for token, the prompt of the chat of ``messages``."""
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert done.usage is not None and chat.usage is not None
    assert done.usage.input_tokens == chat.usage.prompt_tokens


def test_a_string_input_gets_a_response_with_its_text_and_usage(client: openai.OpenAI) -> None:
    done = client.responses.create(model="tiny", input="Hello", max_output_tokens=5, temperature=0)
    assert (done.object, done.status, done.output_text) == ("response", "incomplete", "abcde")
    assert done.incomplete_details is not None and done.incomplete_details.reason == "max_output_tokens"
    assert done.id.startswith("resp_")
    [item] = done.output
    assert (item.type, item.role, item.status) == ("message", "assistant", "completed")  # type: ignore[union-attr]
    assert done.usage is not None
    assert (done.usage.output_tokens, done.usage.total_tokens - done.usage.input_tokens) == (5, 5)


def test_instructions_and_message_items_are_the_prompt_of_the_equivalent_chat(client: openai.OpenAI) -> None:
    items: Any = [{"role": "user", "content": "Hi"}, {"type": "message", "role": "assistant", "content": "yo"},
                  {"role": "user", "content": [{"type": "input_text", "text": "more"}]}]  # fmt: skip
    done = client.responses.create(model="tiny", input=items, instructions="Be brief", max_output_tokens=2)
    chat: Any = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]  # fmt: skip
    _assert_prompt_of_chat(client, done, chat)
    assert done.instructions == "Be brief"


def test_a_streamed_response_sends_every_event_in_order_with_the_whole_responses_text(
    client: openai.OpenAI,
) -> None:
    whole = client.responses.create(model="tiny", input="Hello", max_output_tokens=6, temperature=0)
    with client.responses.stream(model="tiny", input="Hello", max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert 1 <= deltas <= 6
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text == "abcdef"
    assert final.usage is not None and whole.usage is not None
    assert final.usage.model_dump() == whole.usage.model_dump()
    assert final.status == whole.status == "incomplete"


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Hello", max_output_tokens=3)
    follow = client.responses.create(
        model="tiny", input="Again", previous_response_id=first.id, max_output_tokens=2
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Again"},
        ],  # fmt: skip
        max_tokens=2,
    )
    assert follow.previous_response_id == first.id
    assert follow.usage is not None and chat.usage is not None
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(follow.id).model_dump() == follow.model_dump()


def test_a_follow_up_of_an_unknown_or_unstored_response_is_a_404_naming_previous_response_id(
    client: openai.OpenAI,
) -> None:
    unstored = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, store=False)
    for missing in ("resp_nothing", unstored.id):
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.create(
                model="tiny", input="Again", previous_response_id=missing, max_output_tokens=2
            )
        assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert caught.value.body["code"] == "response_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_background_response_is_followed_by_get_and_stopped_by_cancel(slow_server: LiveServer) -> None:
    with slow_server.openai_client() as c:
        started = c.responses.create(model="tiny", input="Hello", max_output_tokens=200, background=True)
        assert (started.status, started.background) == ("queued", True)
        cancelled = c.responses.cancel(started.id)
        assert cancelled.status == "cancelled"
        assert c.responses.retrieve(started.id).status == "cancelled"
        slow_server.wait_until(lambda: slow_server.load()["num_running"] == 0, "the sequence aborted")
        with pytest.raises(openai.BadRequestError):
            c.responses.cancel(started.id)  # no longer running
        done = c.responses.create(model="tiny", input="Hello", max_output_tokens=3, background=True)
        slow_server.wait_until(lambda: c.responses.retrieve(done.id).status != "queued"
                               and c.responses.retrieve(done.id).status != "in_progress", "it finishing")  # fmt: skip
        assert c.responses.retrieve(done.id).output_text == "abc"
        follow = c.responses.create(
            model="tiny", input="Again", previous_response_id=done.id, max_output_tokens=1
        )
        chat: Any = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "abc"},
                     {"role": "user", "content": "Again"}]  # fmt: skip
        _assert_prompt_of_chat(c, follow, chat)


def test_a_deleted_response_is_gone(client: openai.OpenAI) -> None:
    done = client.responses.create(model="tiny", input="Hello", max_output_tokens=2)
    client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)


def _post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, timeout=30)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.function_call_output.call_id"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 5}}}},
         "text.format.schema"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "x", "background": True, "store": False}, "background"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(
    fast_server: LiveServer, body: dict[str, Any], param: str
) -> None:
    resp = _post(fast_server, {"model": "tiny", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_sampling_settings_and_reasoning_are_taken_and_echoed(client: openai.OpenAI) -> None:
    done = client.responses.create(
        model="tiny", input="Hello", max_output_tokens=3, temperature=0.5, top_p=0.9, reasoning={"effort": "low"},
        metadata={"run": "7"},
    )  # fmt: skip
    assert (done.temperature, done.top_p, done.max_output_tokens, done.metadata) == (
        0.5,
        0.9,
        3,
        {"run": "7"},
    )
    assert done.reasoning is not None and done.reasoning.effort == "low"  # a model without reasoning: no-op
    assert done.output_text == "abc"
