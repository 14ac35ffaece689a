"""Bad input through a real router process (at DEBUG) in front of a real simulated engine, as a client meets it.

Every kind of malformed request gets a 4xx OpenAI error body naming the field, keeps the
client's keep-alive connection, and no API key (good or wrong) ever reaches the log.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from kvfleet.testing.openapi_checks import check_every_operation
from kvfleet.testing.processes import SimFlags, routers, sim_engines, tenants_file

KEY = "sk-bad-input-5f0c9d2e7a41"
WRONG_KEY = "sk-wrong-key-b3e81f06c2d9"
AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
LIMIT = 64 * 1024  # the router's --max-request-bytes here
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
GOOD = b'{"model": "tiny", "prompt": "x", "max_tokens": 2}'


class Fleet(NamedTuple):
    url: str
    log: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("bad-input")
    tenants = tenants_file(tmp / "tenants.yaml", [("alice", KEY)])
    log = tmp / "router.log"
    flags = SimFlags(max_num_seqs=8, num_kv_blocks=64, base_ms=1.0, max_model_len=256)
    with sim_engines(1, flags) as engines:
        extra = ["--log-level", "debug", "--max-request-bytes", str(LIMIT)]
        with routers(1, [engines[0].url], tenants, extra=extra, log=log) as started:
            yield Fleet(started[0].url, log)


def _post(fleet: Fleet, path: str, content: bytes) -> httpx.Response:
    with httpx.Client(base_url=fleet.url, timeout=10) as c:
        return c.post(path, content=content, headers=AUTH)


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize(
    ("path", "raw", "status", "param", "message"),
    [
        (COMPLETIONS, b'{"model": "tiny", ', 400, None, "the request body is not valid JSON"),
        (COMPLETIONS, b'[1]', 400, None, "the request body must be a JSON object, got list"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "n": "2"}', 400, "n", "n: Input should be a valid integer"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "top_p": 1.5}', 400, "top_p", "top_p: Input should be less than or equal to 1"),
        (COMPLETIONS, b'{"model": "nope", "prompt": "x"}', 404, "model", "model 'nope' is not served here"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "' + b"x" * 400 + b'"}', 400, "prompt", "maximum context length is 256"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud800"}', 400, "prompt", "lone UTF-16 surrogate"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "\xff"}', 400, None, "not valid UTF-8: invalid start byte at byte 29"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "\xc0\xaf"}', 400, None, "not valid UTF-8"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', 400, None, "not valid UTF-8"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": ""}', 400, "prompt", "prompt: the prompt is empty"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "best_of": 3}', 400, "best_of", "only best_of equal to n"),
        (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "min_tokens": 3}', 400, "min_tokens", "at most max_tokens (2)"),
        (CHAT, b'{"model": "tiny", "messages": []}', 400, "messages", "messages: must contain at least one message"),
        (CHAT, b'{"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}', 400, "messages.0.role", "Input should be"),
        (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', 400, "tools.0.function", "field required"),
        (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}', 400, "response_format", "json_schema is required"),
        (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}', 400, "frobnicate", "not a field this server knows"),
        (RESPONSES, b'{"model": "tiny", "input": []}', 400, "input", "input: the input is empty"),
        (RESPONSES, b'{"model": "tiny", "input": "x", "text": {"format": {"type": "json_schema"}}}', 400, "text.format", "name and schema are required"),
        (RESPONSES, b'{"model": "tiny", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}', 400, "input.0.function_call.call_id", "field required"),
        (RESPONSES, b'{"model": "tiny", "input": "' + b"x" * 400 + b'"}', 400, "input", "maximum context length is 256"),
        (RESPONSES, b'{"model": "tiny", "input": "x", "previous_response_id": "resp_gone"}', 404, "previous_response_id", "no stored response 'resp_gone'"),
        (RESPONSES, b'{"model": "tiny", "input": "x", "previous_response_id": "resp_' + b"0" * 32 + b'_00000000"}', 404, "previous_response_id", "is not in the fleet"),
        (EMBEDDINGS, b'{"model": "tiny"}', 400, "input", "input: field required"),
        (EMBEDDINGS, b'{"model": "tiny", "input": []}', 400, "input", "must be a string, a list of strings"),
        (EMBEDDINGS, b'{"model": "tiny", "input": "x", "encoding_format": "hex"}', 400, "encoding_format", "Input should be 'float' or 'base64'"),
        (EMBEDDINGS, b'{"model": "tiny", "input": "x", "dimensions": 0}', 400, "dimensions", "greater than or equal to 1"),
        (EMBEDDINGS, b'{"model": "nope", "input": "x"}', 404, "model", "model 'nope' is not served here"),
        (EMBEDDINGS, b'{"model": "tiny", "input": "x"}', 400, "model", "serves embeddings only when started with --runner pooling"),
    ],
)  # fmt: skip
def test_every_kind_of_bad_request_is_a_4xx_naming_what_is_wrong(
    fleet: Fleet, path: str, raw: bytes, status: int, param: str | None, message: str
) -> None:
    err = _error(_post(fleet, path, raw), status)
    assert err["param"] == param
    assert message in err["message"]


def test_a_body_over_the_limit_is_a_413_with_or_without_a_content_length(fleet: Fleet) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"x" * LIMIT + b'"}'
    err = _error(_post(fleet, COMPLETIONS, big), 413)
    assert err["message"] == (
        f"the request body is too large: Content-Length is {len(big)}, over the limit of {LIMIT} bytes"
    )

    def chunks() -> Iterator[bytes]:
        yield big[:1000]
        yield big[1000:]

    with httpx.Client(base_url=fleet.url, timeout=10) as c:
        chunked = c.post(COMPLETIONS, content=chunks(), headers=AUTH)
    assert _error(chunked, 413)["code"] == "request_too_large"
    assert _post(fleet, COMPLETIONS, GOOD).status_code == 200


@pytest.mark.parametrize(
    "bad",
    [b'{"model": "tiny", "prompt": "\\ud800"}', b'{"model": "tiny", "prompt": "\xff"}', b'{"model": '],
    ids=["lone-surrogate", "invalid-utf8", "malformed"],
)
def test_a_bad_request_keeps_the_keep_alive_connection_for_the_next_one(fleet: Fleet, bad: bytes) -> None:
    ports = []
    with httpx.Client(base_url=fleet.url, timeout=10, limits=httpx.Limits(max_connections=1)) as c:
        for content, status in ((bad, 400), (GOOD, 200)):
            resp = c.post(COMPLETIONS, content=content, headers=AUTH)
            assert resp.status_code == status, resp.text
            ports.append(resp.extensions["network_stream"].get_extra_info("client_addr")[1])
    assert ports[0] == ports[1]


def test_models_have_a_created_time_and_one_is_retrieved_by_id(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=10, headers=AUTH) as c:
        (card,) = c.get("/v1/models").json()["data"]
        assert (card["id"], card["object"], card["owned_by"]) == ("tiny", "model", "kvfleet")
        assert isinstance(card["created"], int) and card["created"] > 0
        assert c.get("/v1/models/tiny").json() == card
        err = _error(c.get("/v1/models/gpt-4"), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found")


def test_no_api_key_reaches_the_log_even_at_debug(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.url, timeout=10) as c:
        assert c.post(COMPLETIONS, content=GOOD, headers=AUTH).status_code == 200
        assert c.get("/v1/models", headers=AUTH).status_code == 200
        wrong = {**AUTH, "Authorization": f"Bearer {WRONG_KEY}"}
        assert c.post(COMPLETIONS, content=GOOD, headers=wrong).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": WRONG_KEY}).status_code == 401
    log = fleet.log.read_text()
    assert " DEBUG " in log, "the router did not log at DEBUG: the test would prove nothing"
    assert KEY not in log and WRONG_KEY not in log
    assert KEY[8:] not in log and WRONG_KEY[8:] not in log  # nor a tail of one


def test_every_router_operation_answers_as_its_openapi_document_says(fleet: Fleet) -> None:
    paths = check_every_operation(fleet.url, "tiny", 20, headers={"Authorization": f"Bearer {KEY}"})
    assert paths >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/v1/responses",
                     "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"}  # fmt: skip


MESSAGES = "/v1/messages"
HI = '"messages": [{"role": "user", "content": "x"}]'


@pytest.mark.parametrize(
    ("path", "raw", "status", "kind", "message"),
    [
        (MESSAGES, b'{"model": "tiny", ', 400, "invalid_request_error", "the request body is not valid JSON"),
        (MESSAGES, b'{"model": "tiny", "prompt": "\xff"}', 400, "invalid_request_error", "not valid UTF-8"),
        (MESSAGES, f'{{"model": "tiny", {HI}}}'.encode(), 400, "invalid_request_error", "max_tokens: field required"),
        (MESSAGES, f'{{"model": "tiny", {HI}, "max_tokens": 2, "top_k": "5"}}'.encode(), 400, "invalid_request_error", "top_k: Input should be a valid integer"),
        (MESSAGES, f'{{"model": "tiny", {HI}, "max_tokens": 2, "tool_choice": {{"type": "any"}}}}'.encode(), 400, "invalid_request_error", "tool_choice: needs tools"),
        (MESSAGES, f'{{"model": "tiny", {HI}, "max_tokens": 2, "tool_choice": {{"type": "auto"}}, "tools": [{{"name": "f", "input_schema": {{}}}}]}}'.encode(), 400, "invalid_request_error", 'tool_choice: "auto" tool choice requires --enable-auto-tool-choice'),
        (MESSAGES, b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image"}]}]}', 400, "invalid_request_error", "messages.0.content"),
        (MESSAGES, f'{{"model": "tiny", {HI}, "max_tokens": 999}}'.encode(), 400, "invalid_request_error", "maximum context length is 256"),
        (MESSAGES, f'{{"model": "nope", {HI}, "max_tokens": 2}}'.encode(), 404, "not_found_error", "model 'nope' is not served here"),
        (f"{MESSAGES}/count_tokens", f'{{"model": "tiny", {HI}, "system": 5}}'.encode(), 400, "invalid_request_error", "system"),
    ],
)  # fmt: skip
def test_every_kind_of_bad_message_is_a_4xx_in_anthropics_error_shape(
    fleet: Fleet, path: str, raw: bytes, status: int, kind: str, message: str
) -> None:
    with httpx.Client(base_url=fleet.url, timeout=10) as c:
        resp = c.post(path, content=raw, headers={"x-api-key": KEY, "content-type": "application/json"})
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and body["error"]["type"] == kind
    assert message in body["error"]["message"]


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/tokenize", b'{"model": "tiny"}', "prompt"),
        ("/tokenize", b'{"prompt": "x"}', "model"),
        ("/tokenize", b'{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
        ("/detokenize", b'{"model": "tiny", "tokens": ["a"]}', "tokens.0"),
        ("/detokenize", b'{"model": "tiny", "tokens": [100000]}', "tokens.0"),
    ],
)
def test_bad_tokenizer_requests_are_400s_naming_the_field(
    fleet: Fleet, path: str, raw: bytes, param: str
) -> None:
    assert _error(_post(fleet, path, raw), 400)["param"] == param


def test_bad_messages_leave_a_stream_in_flight_undisturbed(fleet: Fleet) -> None:
    headers = {"x-api-key": KEY}
    body = {"model": "tiny", "max_tokens": 40, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with (
        httpx.Client(base_url=fleet.url, timeout=30) as c,
        c.stream("POST", MESSAGES, json=body, headers=headers) as s,
    ):
        assert s.status_code == 200
        lines = s.iter_lines()
        first = next(lines)
        for raw in (b'{"model": ', b'{"model": "tiny", "max_tokens": -1}', b"[]"):
            assert c.post(MESSAGES, content=raw, headers=headers).status_code == 400
        rest = list(lines)
    assert first == "event: message_start" and "event: message_stop" in rest
