"""A cheap server-sent-events reader for OpenAI-style streams (``data: {json}`` events, ``data: [DONE]``).

Where it sits: ``kvfleet.bench.load.stream_one`` feeds it the raw bytes of a streaming
response as they arrive (``aiohttp``'s ``iter_any``, however the network cut them) and gets
back whole events' ``data`` payloads, in order. It does only what OpenAI-compatible
servers (ours, vLLM's, the router) send: ``data:`` lines, blank-line event ends, comments
(``: ping``) and other fields (``event:``, ``id:``) skipped, CRLF line ends tolerated. One
``bytes.split`` per network read instead of a per-line iterator is what keeps the load
client's CPU per token small.
"""

from __future__ import annotations

DONE = b"[DONE]"


class SseReader:
    """Feed it bytes; it returns the ``data`` payload of every event completed by them."""

    def __init__(self) -> None:
        self._tail = b""  # the start of an event whose blank line has not arrived yet

    # Invariant: ``_tail`` never holds a complete event; every complete event is returned once, in order.
    def feed(self, data: bytes) -> list[bytes]:
        buf = self._tail + data
        held = b""
        if b"\r" in buf:
            if buf.endswith(b"\r"):  # maybe a CRLF cut between two reads: decide with the next one
                buf, held = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, tail = buf.split(b"\n\n")
        self._tail = tail + held
        return [p for p in map(event_data, events) if p is not None]


def event_data(event: bytes) -> bytes | None:
    """The ``data`` of one event (several ``data:`` lines joined by newlines); None when it has none."""
    if event.startswith(b"data:") and b"\n" not in event:  # the usual case: one line
        return event[5:].strip()
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
