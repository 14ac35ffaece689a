"""How the fault suite's load classifies the end of a stream (kvfleet/testing/fault_load.py)."""

from __future__ import annotations

import orjson

from kvfleet.testing.fault_load import _Stream, is_openai_error

ERROR = {
    "error": {"message": "the engine stopped", "type": "server_error", "param": None, "code": "engine_failed"}
}


def _seen(*events: object) -> _Stream:
    s = _Stream()
    for e in events:
        s.take(e if isinstance(e, bytes) else orjson.dumps(e))
    return s


def _chunk(finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": "x", "finish_reason": finish}]}


def test_a_whole_stream_is_completed() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    assert _seen(_chunk(), _chunk("length"), usage, b"[DONE]").verdict(2, closed_cleanly=True) == (
        "completed",
        "",
    )


def test_a_stream_cut_short_that_still_ends_with_done_is_lost() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    kind, why = _seen(_chunk(), usage, b"[DONE]").verdict(2, closed_cleanly=True)
    assert kind == "lost" and "truncated" in why


def test_an_error_event_then_done_is_a_clean_error_and_another_shape_is_lost() -> None:
    assert _seen(_chunk(), ERROR, b"[DONE]").verdict(2, closed_cleanly=False) == (
        "clean_error",
        "engine_failed",
    )
    assert _seen(_chunk(), ERROR).verdict(2, closed_cleanly=True) == ("clean_error", "engine_failed")
    assert _seen(_chunk(), ERROR).verdict(2, closed_cleanly=False)[0] == "lost"
    assert _seen(_chunk(), {"error": "boom"}, b"[DONE]").verdict(2, closed_cleanly=True)[0] == "lost"
    assert not is_openai_error({"error": {"message": "m", "type": "t"}})


def test_a_connection_that_breaks_without_a_terminal_event_is_lost() -> None:
    assert _seen(_chunk()).verdict(2, closed_cleanly=False)[0] == "lost"
