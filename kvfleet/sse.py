"""The one server-sent-events reader: OpenAI-style streams (``data: {json}`` events, ``data: [DONE]``).

Where it sits: whatever relays or reads a streaming completion feeds it the raw bytes as
they arrive (``aiohttp``'s ``iter_any``, or an Envoy ext_proc body chunk, however the
network cut them): the router's HTTP relay (:mod:`kvfleet.router.proxy`) and its Envoy
gateway (:mod:`kvfleet.router.gateway.router_gate`) forward the whole events it returns and
read each one's ``data`` with :func:`event_data` (:mod:`kvfleet.router.accounting`); the
bench client (:mod:`kvfleet.bench.load`) takes only the payloads (:meth:`SseReader.payloads`).
It does only what OpenAI-compatible servers (ours, vLLM's, the router) send: ``data:``
lines, blank-line event ends, comments (``: ping``) and other fields (``event:``, ``id:``)
kept in the event but not in its data, CRLF or CR line ends (a CRLF cut between two reads
included) normalised to LF. One ``bytes.split`` per network read instead of a per-line
iterator is what keeps the CPU per token small on both sides.
"""

from __future__ import annotations

DONE = b"[DONE]"


class SseReader:
    """Feed it bytes; it returns every event completed by them, or only their ``data`` payloads."""

    def __init__(self) -> None:
        self._tail = b""  # the start of an event whose blank line has not arrived yet

    # Invariant: ``_tail`` never holds a complete event; every complete event is returned once, in order.
    def events(self, data: bytes) -> list[bytes]:
        """The events completed by ``data``, whole (LF line ends, without their blank line)."""
        buf = self._tail + data
        held = b""
        if b"\r" in buf:
            if buf.endswith(b"\r"):  # maybe a CRLF cut between two reads: decide with the next one
                buf, held = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, tail = buf.split(b"\n\n")
        self._tail = tail + held
        return [e for e in events if e.strip()]

    def feed(self, data: bytes) -> list[bytes]:
        """The ``data`` payload of every event completed by ``data``; events without data are skipped."""
        return [p for p in map(event_data, self.events(data)) if p is not None]

    def take_pending(self) -> bytes:
        """What was read after the last complete event (one the stream ended without closing), once."""
        pending, self._tail = self._tail, b""
        return pending


def event_data(event: bytes) -> bytes | None:
    """The ``data`` of one event (several ``data:`` lines joined by newlines); None when it has none."""
    if event.startswith(b"data:") and b"\n" not in event:  # the usual case: one line
        return event[5:].strip()
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
