"""The byte link between the API process and the engine core process: framed, pickled messages over a socket.

Where it sits: under both sides of the core link, ``engine/core/loop.py`` (the core process's
:func:`~kvfleet.engine.core.loop.core_main`) and ``engine/client/core_client.py`` (the API process's
:class:`~kvfleet.engine.client.core_client.ProcessCore`), carrying ``engine/core/messages.py``'s messages. The
core process talks through a :class:`BlockingLink` (it has nothing else to do while it waits); the API process through an
:class:`AsyncLink` driven by its event loop, so a large message (a burst of long prompts, a
big step batch) never blocks the loop and never fails because a socket buffer is full.

Why not ``multiprocessing.Connection``: its ``send``/``recv`` assume a blocking socket. The
event loop (uvloop) turns the API process's end non-blocking once it watches it, and then a
write into a full buffer raised ``BlockingIOError`` (an ``OSError``), which was taken for
the core's death, and a read that found half a message failed the same way. Here back-
pressure is only ever a wait: the API side queues what the socket will not take yet and
writes it when the socket is writable; the reader keeps a partial frame until the rest
arrives. The link is *closed* only on EOF or a reset, never on a full buffer.

A frame is an 8-byte big-endian length and that many bytes of pickle.
"""

from __future__ import annotations

import asyncio
import pickle
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

HEADER = struct.Struct("!Q")
READ_CHUNK = 1 << 18  # bytes per recv call
READ_BUDGET = 1 << 18  # bytes one readable callback takes before it lets the loop run other work


class LinkClosed(ConnectionError):
    """The other end closed the link or reset it: the peer process is gone."""


def frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


class FrameReader:
    """Bytes in, whole messages out, in order; keeps at most the one partial frame between calls."""

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf
        buf += data
        messages: list[Any] = []
        pos = 0
        while len(buf) - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, pos)
            end = pos + HEADER.size + size
            if end > len(buf):
                break
            with memoryview(buf) as view:
                messages.append(pickle.loads(view[pos + HEADER.size : end]))
            pos = end
        if pos:
            del buf[:pos]
        return messages


def _recv(sock: socket.socket) -> bytes:
    try:
        data = sock.recv(READ_CHUNK)
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise LinkClosed(str(exc)) from exc
    if not data:
        raise LinkClosed("end of stream")
    return data


class BlockingLink:
    """A blocking end of the link: the core process's, and the API process's until the core greets."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self.reader = FrameReader()
        self.inbox: deque[Any] = deque()

    def send(self, message: Any) -> None:
        try:
            self.sock.sendall(frame(message))  # blocks while the reader is behind: back-pressure
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise LinkClosed(str(exc)) from exc

    def poll(self, timeout: float) -> bool:
        """True once a whole message is waiting; False if no byte came within ``timeout`` seconds.

        Once the first bytes of a frame are here the rest is on its way, so it waits for them.
        """
        deadline = time.monotonic() + timeout
        while not self.inbox:
            if not self.reader.pending_bytes:
                left = max(0.0, deadline - time.monotonic())
                if not select.select([self.sock], [], [], left)[0]:
                    return False
            self.inbox.extend(self.reader.feed(_recv(self.sock)))
        return True

    def recv(self) -> Any:
        while not self.inbox:
            self.inbox.extend(self.reader.feed(_recv(self.sock)))
        return self.inbox.popleft()


class AsyncLink:
    """The API process's end once the loop runs: non-blocking, writes queued, reads delivered whole.

    ``on_message`` gets each message in order on the event loop; ``on_closed`` is called once,
    with the reason, when the peer closes or resets the link.
    """

    def __init__(
        self,
        link: BlockingLink,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Any], None],
        on_closed: Callable[[str], None],
    ) -> None:
        self.sock, self._reader, self._loop = link.sock, link.reader, loop
        self._on_message, self._on_closed = on_message, on_closed
        self._out: deque[memoryview] = deque()
        self._closed = False
        self.sock.setblocking(False)
        for message in link.inbox:  # anything read before the loop took over
            loop.call_soon(self._deliver, message)
        link.inbox.clear()
        loop.add_reader(self.sock.fileno(), self.read_ready)

    @property
    def queued_bytes(self) -> int:
        return sum(len(chunk) for chunk in self._out)

    def send(self, message: Any) -> None:
        """Queue ``message`` behind those already queued; write what the socket takes now."""
        if self._closed:
            return
        was_idle = not self._out
        self._out.append(memoryview(frame(message)))
        if was_idle:
            self._flush()
            if self._out and not self._closed:
                self._loop.add_writer(self.sock.fileno(), self._flush)

    def _flush(self) -> None:
        while self._out:
            chunk = self._out[0]
            try:
                sent = self.sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                return  # full: the writer callback resumes when the core has read some
            except OSError as exc:  # EPIPE / ECONNRESET: the core is gone
                self._close(f"write failed: {exc}")
                return
            if sent < len(chunk):
                self._out[0] = chunk[sent:]
                return
            self._out.popleft()
        self._loop.remove_writer(self.sock.fileno())

    def read_ready(self) -> None:
        """Read what is there (up to a budget, then yield to the loop), deliver every whole message."""
        taken = 0
        while not self._closed and taken < READ_BUDGET:
            try:
                data = _recv(self.sock)
            except (BlockingIOError, InterruptedError):
                return
            except (LinkClosed, OSError) as exc:
                self._close(str(exc) or type(exc).__name__)
                return
            taken += len(data)
            for message in self._reader.feed(data):
                self._deliver(message)

    def _deliver(self, message: Any) -> None:
        if not self._closed:
            self._on_message(message)

    def _close(self, reason: str) -> None:
        if self._closed:
            return
        self.detach()
        self._on_closed(reason)

    def detach(self) -> None:
        """Stop watching the socket and drop what is queued (idempotent); the socket stays open."""
        if self._closed:
            return
        self._closed = True
        self._out.clear()
        if not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
            self._loop.remove_writer(self.sock.fileno())

    def finish(self, last: Any, timeout: float) -> None:
        """Send what is queued and then ``last``, waiting up to ``timeout`` s; then detach."""
        if self._closed:
            return
        self._out.append(memoryview(frame(last)))
        chunks = list(self._out)
        self._out.clear()
        self.detach()
        self.sock.settimeout(timeout)
        try:
            for chunk in chunks:
                self.sock.sendall(chunk)
        except OSError:
            pass  # gone or stuck: the caller terminates the process
