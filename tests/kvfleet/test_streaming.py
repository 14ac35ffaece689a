"""The stall-bounded stream and its listening socket (kvfleet/streaming.py)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

from starlette.types import Message

from kvfleet.streaming import StallBoundedStream, listen_socket


async def test_a_write_the_client_never_takes_ends_the_stream_and_closes_its_body() -> None:
    closed = asyncio.Event()
    sent: list[Message] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: {}\n\n"
        finally:
            closed.set()

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and len(sent) >= 2:
            await asyncio.Event().wait()  # the client reads nothing more: this write never goes through
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    stream = StallBoundedStream(body(), stall_timeout_s=0.05)
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    await asyncio.wait_for(stream(scope, receive, send), 10)
    assert stream.stalled and closed.is_set()
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_accepted_connections_keep_the_send_buffer_of_the_listening_socket() -> None:
    with (
        listen_socket("127.0.0.1", 0, send_buffer_kib=16) as server,
        socket.create_connection(server.getsockname()),
    ):
        accepted, _ = server.accept()
        with accepted:  # Linux doubles the size asked for
            assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * 16 * 1024
