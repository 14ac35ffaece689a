"""``/tokenize`` and ``/detokenize`` on a real server, in vLLM's shapes: the simulator's byte tokenizer
(one token per character, ``<s>`` one token) makes every count checkable by hand."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import LiveServer

CHAT: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture
def http(fast_server: LiveServer) -> Iterator[httpx.Client]:
    with fast_server.client() as c:
        yield c


def test_a_prompt_is_tokenized_and_its_tokens_detokenize_to_it(http: httpx.Client) -> None:
    out = http.post("/tokenize", json={"model": "tiny", "prompt": "héllo", "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) == len("héllo".encode()) + 1  # bytes, then <s> first
    assert out["max_model_len"] == 256
    assert "".join(out["token_strs"][1:]).startswith("h")
    plain = http.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False}).json()
    assert plain["tokens"] == out["tokens"][1:] and plain["token_strs"] is None
    back = http.post("/detokenize", json={"model": "tiny", "tokens": plain["tokens"]})
    assert back.json() == {"prompt": "héllo"}


def test_a_chats_token_count_is_the_prompt_tokens_its_completion_reports(
    http: httpx.Client, fast_server: LiveServer
) -> None:
    counted = http.post("/tokenize", json={"model": "tiny", "messages": CHAT}).json()["count"]
    without = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["count"]
    with fast_server.openai_client() as client:
        done = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    assert done.usage is not None and counted == done.usage.prompt_tokens
    assert without == counted - len("<|assistant|>\n")


def test_bad_input_is_a_400_naming_the_field(http: httpx.Client) -> None:
    both = http.post("/tokenize", json={"prompt": "x", "messages": CHAT})
    outside = http.post("/detokenize", json={"tokens": [1, 10**6]})
    negative = http.post("/detokenize", json={"tokens": [-1]})
    unknown = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert (both.status_code, both.json()["error"]["param"]) == (400, "prompt")
    assert (outside.status_code, outside.json()["error"]["param"]) == (400, "tokens.1")
    assert "outside the vocabulary" in outside.json()["error"]["message"]
    assert (negative.status_code, negative.json()["error"]["param"]) == (400, "tokens.0")
    assert (unknown.status_code, unknown.json()["error"]["param"]) == (404, "model")
