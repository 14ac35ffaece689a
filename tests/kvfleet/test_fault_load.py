"""How the fault suite's load classifies the end of a stream (kvfleet/testing/fault_load.py)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import aiohttp
import orjson

from kvfleet.testing.fault_load import Outcome, Tenant, _Stream, completion_body, is_openai_error, one_request

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


def _reset_after(reply: bytes) -> tuple[socket.socket, str]:
    """A listener that reads one request, writes ``reply``, then resets the connection (RST)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(reply)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


async def _one(url: str) -> Outcome:
    async with aiohttp.ClientSession() as session:
        body = completion_body("tiny", 4, "hi")
        return await one_request(session, url, Tenant("acme", "k"), body, bound_s=10)


def test_a_connection_reset_before_any_response_was_never_accepted() -> None:
    server, url = _reset_after(b"")
    with server:
        outcome = asyncio.run(_one(url))
    assert (outcome.kind, outcome.detail) == ("refused", "connection reset before any response")


def test_a_connection_reset_after_the_response_began_is_lost() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    server, url = _reset_after(head + b"5\r\ndata:\r\n")
    with server:
        outcome = asyncio.run(_one(url))
    assert outcome.kind == "lost" and outcome.status == 200
