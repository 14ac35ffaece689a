"""The one SSE reader (kvfleet/sse.py) as the router's relays use it: whole events, however the bytes are cut."""

from __future__ import annotations

from kvfleet.sse import SseReader, event_data

STREAM = b'data: {"a": 1}\r\n\r\n: ping\r\n\r\nevent: x\r\ndata: one\r\ndata: two\r\n\r\ndata: [DONE]\r\n\r\n'
EVENTS = [b'data: {"a": 1}', b": ping", b"event: x\ndata: one\ndata: two", b"data: [DONE]"]


def test_events_come_whole_and_once_at_every_cut_including_a_crlf_split_across_reads() -> None:
    for cut in range(1, len(STREAM)):
        reader = SseReader()
        assert reader.events(STREAM[:cut]) + reader.events(STREAM[cut:]) == EVENTS, cut


def test_events_come_whole_when_the_stream_arrives_one_byte_at_a_time() -> None:
    reader = SseReader()
    assert [e for i in range(len(STREAM)) for e in reader.events(STREAM[i : i + 1])] == EVENTS


def test_an_event_the_stream_never_closed_is_pending_once() -> None:
    reader = SseReader()
    assert reader.events(b"data: 1\n\ndata: 2") == [b"data: 1"]
    assert reader.take_pending() == b"data: 2"
    assert reader.take_pending() == b""


def test_event_data_joins_data_lines_and_is_none_without_any() -> None:
    assert [event_data(e) for e in EVENTS] == [b'{"a": 1}', None, b"one\ntwo", b"[DONE]"]
