"""A streamed HTTP response that gives up on a client that stops reading (docs/architecture.md §5, §6).

Where it sits: the engine's SSE responses (``engine/server/sse.py``) and the router's relay
(``router/proxy.py``) are :class:`StallBoundedStream` s, served from a listening socket made
by :func:`listen_socket`. Back-pressure bounds the bytes a stream holds: the kernel's send
buffer of each connection is fixed at ``send_buffer_kib`` (Linux would otherwise grow it to
``net.ipv4.tcp_wmem``'s maximum, 4 MiB, for a client that reads nothing), uvicorn stops
taking writes while its transport buffer is over its high-water mark (64 KiB), so the body
iterator waits in ``send`` and reads nothing more from the engine (the router's aiohttp
reader then stops reading the engine's socket, and so on back). What back-pressure alone
never ends is the wait: a client that keeps its connection open and
reads nothing would hold its sequence, its concurrency slot and its tokens for ever. Here a
write that waits longer than ``stall_timeout_s`` ends the stream: the body iterator is
closed at once (its clean-up aborts the sequence, or closes the upstream stream and settles
the quota) and uvicorn drops the connection.
"""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import AsyncIterable, Mapping

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT_S = 30.0
DEFAULT_SEND_BUFFER_KIB = 256


def add_stream_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--stream-stall-timeout`` and ``--stream-send-buffer``, the same for the engine, the router and ``kvfleet up``."""
    parser.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="seconds a client may read nothing of its stream before the stream is aborted (default 30)",
    )
    parser.add_argument(
        "--stream-send-buffer",
        type=int,
        default=DEFAULT_SEND_BUFFER_KIB,
        metavar="KIB",
        help="each client connection's kernel send buffer in KiB: what a client that reads nothing can hold "
        "(default 256)",
    )


def listen_socket(host: str, port: int, send_buffer_kib: int = DEFAULT_SEND_BUFFER_KIB) -> socket.socket:
    """A listening TCP socket for uvicorn (``Server.run(sockets=[...])``) whose accepted connections
    inherit a fixed kernel send buffer of ``send_buffer_kib`` (Linux doubles it for its bookkeeping)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_kib * 1024)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


class StreamStalled(Exception):
    """A write to the client waited longer than the stall bound (not an ``OSError``: Starlette
    turns those into a quiet client disconnect)."""


class StallBoundedStream(StreamingResponse):
    """A ``StreamingResponse`` whose every write to the client must go through within ``stall_timeout_s``.

    Invariant: when :meth:`__call__` returns, the body iterator has been closed (its ``finally``
    has run), whether the stream ended, the client left or the client stalled.
    """

    def __init__(
        self,
        content: AsyncIterable[str | bytes],
        *,
        stall_timeout_s: float,
        media_type: str = "text/event-stream",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.stall_timeout_s = stall_timeout_s
        self.stalled = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def bounded_send(message: Message) -> None:
            try:
                with anyio.fail_after(self.stall_timeout_s):
                    await send(message)
            except TimeoutError:
                raise StreamStalled from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except StreamStalled:
            self.stalled = True
            log.warning(
                "a client read nothing of its stream for %.1f s: the stream is aborted", self.stall_timeout_s
            )
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
