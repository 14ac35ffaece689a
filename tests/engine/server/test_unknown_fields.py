"""The engine serves bodies with top-level fields it does not know (as vLLM does), logs each once, counts it.

Routers and gateways in front of engines add fields of their own (vllm-router adds
``no_stop_trim``); the router, which users talk to, still refuses them (tests/router/test_bad_input.py).
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from kvfleet.engine.server import unknown_fields
from kvfleet.engine.server.unknown_fields import IgnoredFields
from kvfleet.openai_api import IGNORE_UNKNOWN_FIELDS, APIError, CompletionRequest, validate_request

if TYPE_CHECKING:
    from conftest import LiveServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "x"}]
LOGGER = "kvfleet.engine.server.unknown_fields"


def _post(live: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    with live.client() as c:
        return c.post(path, json=body)


def _ignored(live: LiveServer, field: str) -> float:
    with live.client() as c:
        text = c.get("/metrics").text
    m = re.search(
        rf'^kvfleet_engine_ignored_request_fields_total{{(?=[^}}]*model_name="tiny")[^}}]*field="{field}"[^}}]*}} (\S+)$',
        text,
        re.M,
    )
    return 0.0 if m is None else float(m.group(1))


def _streamed_content(sse: str) -> str:
    events = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


def test_a_completion_with_unknown_fields_is_served_as_without_them_and_each_is_counted(
    fast_server: LiveServer,
) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5}
    resp = _post(fast_server, COMPLETIONS, body | {"no_stop_trim": True, "kvfleet_test_a": {"x": 1}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "abcde"
    assert (_ignored(fast_server, "no_stop_trim"), _ignored(fast_server, "kvfleet_test_a")) == (1.0, 1.0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_with_an_unknown_field_is_served_streamed_or_not(
    fast_server: LiveServer, stream: bool
) -> None:
    before = _ignored(fast_server, "kvfleet_test_chat")
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "stream": stream, "kvfleet_test_chat": 1}
    resp = _post(fast_server, CHAT, body)
    assert resp.status_code == 200, resp.text
    if stream:
        assert resp.text.endswith("data: [DONE]\n\n")
        assert _streamed_content(resp.text) == "abc"
    else:
        assert resp.json()["choices"][0]["message"]["content"] == "abc"
    assert _ignored(fast_server, "kvfleet_test_chat") == before + 1


def test_each_ignored_field_is_logged_once_per_process_at_warning(
    fast_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1, "kvfleet_test_once": True}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            assert _post(fast_server, COMPLETIONS, body).status_code == 200
    lines = [r for r in caplog.records if r.name == LOGGER and "kvfleet_test_once" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in lines] == [
        ("WARNING", "ignoring request field 'kvfleet_test_once': not a field this server knows (logged once)")
    ]
    assert _ignored(fast_server, "kvfleet_test_once") == 3.0


@pytest.mark.parametrize(
    ("path", "extra", "param", "message"),
    [
        (COMPLETIONS, {"use_beam_search": True}, "use_beam_search", "use_beam_search: beam search is not implemented; remove it"),
        (COMPLETIONS, {"stream_options": {"include_usage": True, "kvfleet_test_nested": 1}}, "stream_options.kvfleet_test_nested", "stream_options.kvfleet_test_nested: not a field this server knows; remove it"),
        (CHAT, {"messages": [{"role": "user", "content": "x", "kvfleet_test_nested": 1}]}, "messages.0.kvfleet_test_nested", "messages.0.kvfleet_test_nested: not a field this server knows; remove it"),
    ],
)  # fmt: skip
def test_known_unimplemented_fields_and_unknown_nested_fields_stay_400s_on_the_engine(
    fast_server: LiveServer, path: str, extra: dict[str, Any], param: str, message: str
) -> None:
    base: dict[str, Any] = {"model": "tiny", "max_tokens": 1}
    base |= {"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES}
    resp = _post(fast_server, path, base | extra)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["message"]) == (param, message)


def test_the_shared_models_refuse_unknown_fields_unless_a_caller_asked_to_ignore_them() -> None:
    body = {"model": "m", "prompt": "x", "no_stop_trim": True}
    with pytest.raises(APIError) as refused:
        validate_request(CompletionRequest, body)
    assert (refused.value.status_code, refused.value.param) == (400, "no_stop_trim")
    assert refused.value.message == "no_stop_trim: not a field this server knows; remove it"
    seen: list[list[str]] = []
    token = IGNORE_UNKNOWN_FIELDS.set(seen.append)
    try:
        parsed = validate_request(CompletionRequest, body | {"use_beam_search_not": 1})
    finally:
        IGNORE_UNKNOWN_FIELDS.reset(token)
    assert (parsed.prompt, seen) == ("x", [["no_stop_trim", "use_beam_search_not"]])


def test_past_the_named_limit_further_names_share_one_label(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unknown_fields, "_seen", set())
    monkeypatch.setattr(unknown_fields, "MAX_NAMED", 2)
    counted: list[str] = []
    IgnoredFields(counted.append)(["a", "b", "c", "a", "d", "x" * 65])
    assert counted == ["a", "b", "_other", "a", "_other", "_other"]
