"""Structured outputs over HTTP: the official client's ``parse`` on real SmolLM2, refusals from the core.

The engine core runs in its own process here, so a grammar the core cannot compile comes
back as the request's 400 through the deferred verdict (engine/structured).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
from pydantic import BaseModel

if TYPE_CHECKING:
    from conftest import LiveServer


class Person(BaseModel):
    name: str
    age: int


def test_the_openai_client_parses_a_pydantic_model_from_smollm2(smollm2_server: LiveServer) -> None:
    with smollm2_server.openai_client() as client:
        done = client.chat.completions.parse(
            model="smollm2",
            messages=[{"role": "user", "content": "Alice is 30 years old. Give her name and age as JSON."}],
            response_format=Person,
            max_tokens=40,
            temperature=0,
        )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == '{"name": "Alice", "age": 30}'  # in the schema's order, as OpenAI
    assert choice.message.parsed == Person(name="Alice", age=30)


def _post(url: str, path: str, body: dict[str, object]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as c:
        return c.post(path, json=body)


def test_a_grammar_the_core_cannot_compile_is_a_400_naming_the_field(tiny_server: LiveServer) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "guided_grammar": 'root ::= "a" |'}
    resp = _post(tiny_server.url, "/v1/completions", body)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "guided_grammar"
    assert err["message"].startswith(
        "guided_grammar: the grammar engine cannot compile it: EBNF parser error"
    )


def test_a_streamed_json_schema_chat_sends_json_that_validates(tiny_server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"],
    }
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 40,
        "seed": 1,
        "stream": True,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": schema, "strict": True},
        },
    }
    text, reasons = "", []
    with (
        httpx.Client(base_url=tiny_server.url, timeout=30) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                reasons.append(choice["finish_reason"])
    assert reasons[-1] == "stop"
    assert list(json.loads(text)) == ["n"] and 1 <= json.loads(text)["n"] <= 9


def test_an_engine_without_a_model_refuses_a_constraint_naming_the_field(fast_server: LiveServer) -> None:
    resp = _post(
        fast_server.url, "/v1/completions", {"model": "tiny", "prompt": "x", "guided_choice": ["a", "b"]}
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "guided_choice"
    assert (
        resp.json()["error"]["message"]
        == "guided_choice: structured outputs need a model (this engine has none)"
    )
