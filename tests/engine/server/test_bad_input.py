"""Every kind of bad input gets an OpenAI error body with the right status, and disturbs nothing else."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import LiveServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


def _post(live: LiveServer, path: str, content: bytes | None = None, json: Any = None) -> httpx.Response:
    with live.client() as c:
        return c.post(path, content=content, json=json, headers={"content-type": "application/json"})


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


def test_malformed_json_is_a_400(fast_server: LiveServer) -> None:
    err = _error(_post(fast_server, COMPLETIONS, content=b'{"model": "tiny", '), 400)
    assert err["message"].startswith("the request body is not valid JSON")
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": "x"}, "model", "model: field required"),
        ({"model": "tiny"}, "prompt", "prompt: field required"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, "max_tokens", "max_tokens: Input should be a valid integer (got '5')"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -3}, "max_tokens", "max_tokens: Input should be greater than or equal to 1 (got -3)"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10**12}, "max_tokens", f"max_tokens: Input should be less than or equal to {1 << 31} (got {10**12})"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature", "temperature: Input should be greater than or equal to 0 (got -1)"),
        ({"model": "tiny", "prompt": {"text": "x"}}, "prompt", None),
        ({"model": "tiny", "prompt": "x", "n": 0}, "n", "n: Input should be greater than or equal to 1 (got 0)"),
    ],
)  # fmt: skip
def test_wrong_types_missing_fields_and_ranges_name_the_field(
    fast_server: LiveServer, body: dict[str, Any], param: str, message: str | None
) -> None:
    err = _error(_post(fast_server, COMPLETIONS, json=body), 400)
    assert err["param"] == param
    if message is not None:
        assert err["message"] == message


def test_a_max_tokens_beyond_the_context_names_both_lengths(fast_server: LiveServer) -> None:
    err = _error(
        _post(fast_server, COMPLETIONS, json={"model": "tiny", "prompt": "Hello", "max_tokens": 251}), 400
    )
    assert err["message"] == (
        "max_tokens: this model's maximum context length is 256 tokens, but the request asks for 257 "
        "(6 in the prompt, 251 for the completion)"
    )
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")


def test_a_prompt_over_the_context_names_both_lengths(fast_server: LiveServer) -> None:
    err = _error(_post(fast_server, COMPLETIONS, json={"model": "tiny", "prompt": "x" * 300}), 400)
    assert err["message"] == (
        "prompt: the prompt is 301 tokens, but this model's maximum context length is 256 tokens "
        "(prompt and completion together)"
    )
    err = _error(
        _post(
            fast_server, CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "x" * 300}]}
        ),
        400,
    )
    assert err["code"] == "context_length_exceeded"


def test_token_ids_outside_the_vocabulary_are_named(fast_server: LiveServer) -> None:
    err = _error(_post(fast_server, COMPLETIONS, json={"model": "tiny", "prompt": [1, 999]}), 400)
    assert err["message"] == "prompt: token id 999 is outside the vocabulary (size 259)"


def test_an_unknown_model_is_a_404_model_not_found(fast_server: LiveServer) -> None:
    err = _error(
        _post(fast_server, CHAT, json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}), 404
    )
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert err["message"] == "The model 'gpt-4' does not exist; this server serves 'tiny'"


def test_an_empty_message_list_and_a_bad_role_are_400s(fast_server: LiveServer) -> None:
    err = _error(_post(fast_server, CHAT, json={"model": "tiny", "messages": []}), 400)
    assert err["message"] == "messages: must contain at least one message"
    err = _error(
        _post(fast_server, CHAT, json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}), 400
    )
    assert err["param"] == "messages.0.role"


def test_unknown_paths_and_methods_get_error_bodies(fast_server: LiveServer) -> None:
    with fast_server.client() as c:
        assert _error(c.get("/v1/nothing"), 404)["type"] == "not_found_error"
        assert _error(c.get(COMPLETIONS), 405)["message"] == "Method Not Allowed"


def test_bad_requests_leave_the_engine_idle_and_good_ones_served(fast_server: LiveServer) -> None:
    for body in ({"model": "tiny", "prompt": "x" * 300}, {"model": "nope", "prompt": "x"}, {"model": "tiny"}):
        assert _post(fast_server, COMPLETIONS, json=body).status_code in (400, 404)
    load = fast_server.load()
    assert (load["num_running"], load["num_waiting"], load["kv_cache_usage"]) == (0, 0, 0.0)
    ok = _post(fast_server, COMPLETIONS, json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["text"] == "ab"


def _same_connection_pair(live: LiveServer, bad: bytes, path: str = COMPLETIONS) -> tuple[int, int]:
    """A bad body then a good one through one client holding one connection; the local ports used."""
    ports = []
    with httpx.Client(base_url=live.url, timeout=10, limits=httpx.Limits(max_connections=1)) as c:
        for content in (bad, b'{"model": "tiny", "prompt": "x", "max_tokens": 2}'):
            resp = c.post(path, content=content, headers={"content-type": "application/json"})
            assert resp.status_code == (
                200 if content.startswith(b'{"model": "tiny", "prompt": "x"') else 400
            )
            ports.append(resp.extensions["network_stream"].get_extra_info("client_addr")[1])
    return ports[0], ports[1]


@pytest.mark.parametrize(
    "bad",
    [b'{"model": "tiny", "prompt": "\\ud800"}', b'{"model": "tiny", "prompt": "\xff"}', b'{"model": '],
    ids=["lone-surrogate", "invalid-utf8", "malformed"],
)
def test_an_error_keeps_the_keep_alive_connection_for_the_next_request(
    fast_server: LiveServer, bad: bytes
) -> None:
    first, second = _same_connection_pair(fast_server, bad)
    assert first == second


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (COMPLETIONS, b'{"model": "tiny", "prompt": "a\\ud800"}', "prompt"),
        (
            CHAT,
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
            "messages.0.content",
        ),
        ("/tokenize", b'{"prompt": "\\udbff\\udbff"}', "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udbff"}]}', "messages.0.content"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(
    fast_server: LiveServer, path: str, raw: bytes, param: str
) -> None:
    err = _error(_post(fast_server, path, content=raw), 400)
    assert err["param"] == param
    assert "lone UTF-16 surrogate" in err["message"]


@pytest.mark.parametrize(
    "raw", [b'{"prompt": "\xff"}', b'{"prompt": "\xc0\xaf"}', b'{"prompt": "\xed\xa0\x80"}']
)
def test_invalid_utf8_is_a_400_naming_the_byte(fast_server: LiveServer, raw: bytes) -> None:
    err = _error(_post(fast_server, COMPLETIONS, content=raw), 400)
    assert err["message"].startswith("the request body is not valid UTF-8: invalid")
    assert err["code"] == "invalid_utf8"


def test_a_body_over_the_limit_is_a_413_and_the_server_stays_up(fast_server: LiveServer) -> None:
    body = b'{"model": "tiny", "prompt": "' + b"x" * (8 << 20) + b'"}'
    err = _error(_post(fast_server, COMPLETIONS, content=body), 413)
    assert err["message"] == (
        f"the request body is too large: Content-Length is {len(body)}, over the limit of {8 << 20} bytes"
    )
    assert err["code"] == "request_too_large"
    assert (
        _post(fast_server, COMPLETIONS, json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code
        == 200
    )


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, "response_format.json_schema.schema", "not a valid JSON schema at type: 5 is not valid"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "only chat completions call tools"),
        ({"guided_regex": "a("}, "guided_regex", "guided_regex: not a valid regular expression: missing ), unterminated subpattern"),
        ({"guided_choice": []}, "guided_choice", "guided_choice: the choice list is empty"),
        ({"guided_json": "{"}, "guided_json", "guided_json: the schema is not valid JSON"),
        ({"guided_regex": "a+", "structured_outputs": {"choice": ["a"]}}, "guided_regex", "only one structured-output constraint per request, but structured_outputs.choice is set too"),
        ({"best_of": 4}, "best_of", "only best_of equal to n"),
        ({"logit_bias": {"300": 5}}, "logit_bias", "logit_bias: token id 300 is outside the vocabulary (size 259)"),
        ({"max_tokens": 3, "min_tokens": 4}, "min_tokens", "must be at most max_tokens (3)"),
    ],
)  # fmt: skip
def test_what_the_engine_does_not_implement_is_refused_naming_the_field(
    fast_server: LiveServer, body: dict[str, Any], param: str, message: str
) -> None:
    err = _error(_post(fast_server, COMPLETIONS, json={"model": "tiny", "prompt": "x"} | body), 400)
    assert err["param"] == param
    assert message in err["message"]


def test_chat_min_tokens_over_what_the_context_leaves_is_a_400(fast_server: LiveServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "min_tokens": 1000}
    err = _error(_post(fast_server, CHAT, json=body), 400)
    assert err["param"] == "min_tokens"
    assert err["message"].startswith("min_tokens: must be in [0, max_tokens=")


def test_include_stop_str_in_output_keeps_the_stop_string(fast_server: LiveServer) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "stop": "cd"}
    assert _post(fast_server, COMPLETIONS, json=body).json()["choices"][0]["text"] == "ab"
    kept = _post(fast_server, COMPLETIONS, json=body | {"include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["text"] == "abcd"


def test_one_model_is_retrieved_by_its_id_and_an_unknown_one_is_a_404(fast_server: LiveServer) -> None:
    with fast_server.client() as c:
        card = c.get("/v1/models/tiny").json()
        assert (card["id"], card["object"], card["owned_by"]) == ("tiny", "model", "kvfleet")
        assert card["created"] == c.get("/v1/models").json()["data"][0]["created"]
        err = _error(c.get("/v1/models/gpt-4"), 404)
    assert (err["code"], err["param"]) == ("model_not_found", "model")


RESPONSES_BAD: list[tuple[Any, str]] = [
    ({"input": "x"}, "model"),
    ({"model": "tiny"}, "input"),
    ({"model": "tiny", "input": [{"role": "robot", "content": "x"}]}, "input.0.message.role"),
    ({"model": "tiny", "input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"model": "tiny", "input": "x" * 300}, "input"),
    ({"model": "tiny", "input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools.0.name"),
    ({"model": "tiny", "input": "x", "previous_response_id": "resp_gone"}, "previous_response_id"),
]


def test_bad_responses_requests_name_the_field_and_leave_a_stream_in_flight_whole(
    slow_server: LiveServer,
) -> None:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 12, "stream": True}
    with slow_server.client() as c, c.stream("POST", "/v1/responses", json=body) as stream:
        assert stream.status_code == 200
        for bad, param in RESPONSES_BAD:
            resp = _post(slow_server, "/v1/responses", json=bad)
            assert resp.status_code in (400, 404), resp.text
            error = _error(resp, resp.status_code)
            assert error["param"] == param, error
        text = "".join(stream.iter_text())
    assert text.count("response.output_text.delta") >= 2  # event: and type: of each delta
    assert text.rstrip().endswith("}") and '"type":"response.completed"' in text
    assert '"text":"abcdefghijkl"' in text


def _anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    message: str = body["error"]["message"]
    return message


@pytest.mark.parametrize(
    ("raw", "status", "kind", "message"),
    [
        (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
         "invalid_request_error", "messages.0.content: invalid unicode: a lone UTF-16 surrogate"),
        (b'{"model": "tiny", "max_tokens": 2, "messages": "\xff"}', 400, "invalid_request_error",
         "the request body is not valid UTF-8"),
        (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}', 400,
         "invalid_request_error", "messages.0.role: Input should be 'user' or 'assistant'"),
        (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "x"}',
         400, "invalid_request_error", "stop_sequences: Input should be a valid list"),
        (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "a b",'
         b' "input_schema": {}}]}', 400, "invalid_request_error", "tools.0.name: String should match pattern"),
        (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f",'
         b' "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}}', 400, "invalid_request_error",
         "tool_choice: the tool 'g' is not in tools"),
        (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f",'
         b' "input_schema": {"type": 5}}], "tool_choice": {"type": "any"}}', 400, "invalid_request_error",
         "tools.0.input_schema: not a valid JSON schema"),
        (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]}',
         400, "invalid_request_error", "stop_sequences"),
        (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "top_p": 0}', 400,
         "invalid_request_error", "top_p: Input should be greater than 0"),
        (b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "' + b"x" * (8 << 20) + b'"}]}',
         413, "request_too_large", "the request body is too large"),
    ],
)  # fmt: skip
def test_a_bad_message_is_an_error_in_anthropics_shape_naming_the_field(
    fast_server: LiveServer, raw: bytes, status: int, kind: str, message: str
) -> None:
    assert message in _anthropic_error(_post(fast_server, "/v1/messages", content=raw), status, kind)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "input", "input: field required"),
        ({"input": []}, "input", "input: must be a string, a list of strings, a list of token ids, or a list of token-id lists (non-empty)"),
        ({"input": [[]]}, "input", None),
        ({"input": [[999999]]}, "input", "input: token id 999999 is outside the vocabulary (size 259)"),
        ({"input": [[256] * 300]}, "input", "input: input is 300 tokens, but this model's maximum context length is 256 tokens"),
        ({"input": ["x"] * 2049}, "input", "input: at most 2048 inputs in one request, got 2049"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "encoding_format: Input should be 'float' or 'base64' (got 'hex')"),
        ({"input": "x", "dimensions": 0}, "dimensions", "dimensions: Input should be greater than or equal to 1 (got 0)"),
        ({"input": "x", "dimensions": 129}, "dimensions", "dimensions: dimensions must be between 1 and 128, got 129"),
    ],
)  # fmt: skip
def test_bad_embeddings_input_names_the_field_and_disturbs_a_request_in_flight_not(
    pooling_server: LiveServer, body: dict[str, Any], param: str, message: str | None
) -> None:
    big = {"model": "tiny-embed", "input": [[256, *range(i % 200, i % 200 + 40)] for i in range(256)]}
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_post, pooling_server, EMBEDDINGS, None, big)
        err = _error(_post(pooling_server, EMBEDDINGS, json={"model": "tiny-embed", **body}), 400)
        done = in_flight.result(timeout=60)
    assert err["param"] == param
    if message is not None:
        assert err["message"] == message
    assert done.status_code == 200 and len(done.json()["data"]) == 256
