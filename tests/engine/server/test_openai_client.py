"""The official ``openai`` client against a real server: the simulator's k-th token is the k-th letter."""

from __future__ import annotations

from typing import TYPE_CHECKING

import openai
import pytest

if TYPE_CHECKING:
    from conftest import LiveServer


def test_a_completion_returns_the_text_the_finish_reason_and_the_usage(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert done.object == "text_completion"
    assert [(c.index, c.text, c.finish_reason) for c in done.choices] == [(0, "abcde", "length")]
    assert done.usage is not None
    # The byte tokenizer: BOS + one token per byte.
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (6, 5, 11)


def test_a_streamed_completion_sends_the_tokens_in_order_then_the_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="tiny", prompt="Hi", max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    # One chunk per step, or fewer when this client lagged and its pending tokens merged into one.
    assert ("".join(texts), all(texts), 1 <= len(texts) <= 4) == ("abcd", True, True)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons == [None] * (len(texts) - 1) + ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 4)


def test_a_streamed_n_2_completion_sends_each_choices_text_once_and_its_finish_once(
    slow_server: LiveServer,
) -> None:
    # 20 ms steps: the reader keeps up, so every step is its own chunk (nothing coalesces).
    with slow_server.openai_client() as client:
        chunks = list(client.completions.create(model="tiny", prompt="x", max_tokens=3, n=2, stream=True))
    texts = {0: "", 1: ""}
    finishes = []
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
        if c.choices[0].finish_reason is not None:
            finishes.append((c.choices[0].index, c.choices[0].finish_reason))
    # The first sample finishes a step before its fork; it is not repeated in the fork's last chunk.
    assert (texts, sorted(finishes)) == ({0: "abc", 1: "abc"}, [(0, "length"), (1, "length")])


def test_several_prompts_and_n_number_the_choices_prompt_major(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny", prompt=["x", "yy"], max_tokens=2, n=2, seed=3)
    assert [(c.index, c.text) for c in done.choices] == [(0, "ab"), (1, "ab"), (2, "ab"), (3, "ab")]
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (2 + 3, 8)


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny", prompt="Hi", max_tokens=10, stop=["d"])
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("abc", "stop")


def test_token_id_prompts_and_logprobs(client: openai.OpenAI) -> None:
    done = client.completions.create(model="tiny", prompt=[72, 105], max_tokens=3, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["a", "b", "c"]
    assert lp.token_logprobs == [0.0, 0.0, 0.0]
    assert lp.text_offset == [0, 1, 2]
    assert lp.top_logprobs == [{"a": 0.0, "b": -10.0}, {"b": 0.0, "c": -10.0}, {"c": 0.0, "d": -10.0}]
    assert done.usage is not None and done.usage.prompt_tokens == 2


def test_a_chat_completion_answers_as_the_assistant(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
    )
    assert done.object == "chat.completion"
    assert (done.choices[0].message.role, done.choices[0].message.content) == ("assistant", "abc")
    assert done.choices[0].finish_reason == "length"
    rendered = "<s><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (
        len(rendered) - 2,
        3,
    )  # "<s>" is one token


def test_a_streamed_chat_opens_with_the_role_and_ends_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_completion_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=1,
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == "abc"
    assert with_choices[-1].choices[0].finish_reason == "length"
    tokens = [
        t.token for c in with_choices if c.choices[0].logprobs for t in c.choices[0].logprobs.content or []
    ]
    assert tokens == ["a", "b", "c"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_the_model_list_names_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_an_unknown_model_is_the_clients_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert info.value.code == "model_not_found"
