"""The core link: back-pressure is a wait, never a failure; messages arrive whole and in order; only EOF is death."""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading
import time
from typing import Any

import pytest

from kvfleet.engine.link import HEADER, AsyncLink, BlockingLink, FrameReader, LinkClosed, frame

from ..waiting import wait_until


def test_a_frame_is_its_pickle_behind_an_eight_byte_length() -> None:
    data = frame(("add", [1, 2, 3]))
    assert HEADER.unpack_from(data)[0] == len(data) - 8
    assert pickle.loads(data[8:]) == ("add", [1, 2, 3])


def test_the_reader_returns_each_message_once_whole_however_the_bytes_are_cut() -> None:
    messages = [("a", list(range(n))) for n in (0, 1, 300, 5000)]
    wire = b"".join(frame(m) for m in messages)
    for cut in (1, 7, 8, 9, 1000, len(wire)):
        reader, got = FrameReader(), []
        for i in range(0, len(wire), cut):
            got += reader.feed(wire[i : i + cut])
        assert (got, reader.pending_bytes) == (messages, 0), f"cut every {cut} bytes"


def test_the_reader_keeps_a_partial_frame_until_its_last_byte() -> None:
    reader, wire = FrameReader(), frame("x" * 100)
    assert reader.feed(wire[:-1]) == []
    assert reader.pending_bytes == len(wire) - 1
    assert reader.feed(wire[-1:]) == ["x" * 100]


class Linked:
    """An AsyncLink on the running loop over one end of a socket pair, recording what it receives and why it closed."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.got: list[Any] = []
        self.closed: list[str] = []
        loop = asyncio.get_running_loop()
        self.link = AsyncLink(BlockingLink(self.ours), loop, self.got.append, self.closed.append)


async def test_sending_far_more_than_the_socket_buffer_queues_instead_of_failing() -> None:
    pair = Linked()
    ours, theirs, link, closed = pair.ours, pair.theirs, pair.link, pair.closed
    big = [list(range(20_000)) for _ in range(60)]  # ~6 MB of pickles, the buffers hold ~0.2-0.4 MB
    for i, ids in enumerate(big):
        link.send((i, ids))  # never raises, never blocks
    assert link.queued_bytes > 0, "the socket could not take it all at once: the rest waits"
    peer, got = BlockingLink(theirs), []
    reading = threading.Thread(target=lambda: got.extend(peer.recv() for _ in big), daemon=True)
    reading.start()
    # bounded: the loop flushes as the peer reads
    await wait_until(lambda: not reading.is_alive(), 500)
    assert [i for i, _ in got] == list(range(60)) and got[-1][1] == big[-1]
    assert (link.queued_bytes, closed) == (0, [])
    link.detach()
    ours.close(), theirs.close()


async def test_a_large_message_from_the_peer_arrives_whole_through_the_event_loop() -> None:
    pair = Linked()
    ours, theirs, link, got = pair.ours, pair.theirs, pair.link, pair.got
    payload = ["token"] * 2_000_000  # ~4 MB: many reads, across several loop callbacks
    sender = threading.Thread(target=lambda: BlockingLink(theirs).send(payload), daemon=True)
    sender.start()
    await wait_until(lambda: got, 1000)
    assert got == [payload]
    link.detach()
    ours.close(), theirs.close()


async def test_only_the_peer_closing_its_end_closes_the_link() -> None:
    pair = Linked()
    ours, theirs, link, got, closed = pair.ours, pair.theirs, pair.link, pair.got, pair.closed
    BlockingLink(theirs).send("last words")
    theirs.close()
    await wait_until(lambda: closed, 200)
    assert (got, closed) == (["last words"], ["end of stream"])
    link.send("to nobody")  # after the close: dropped, no error
    ours.close()


def test_a_blocking_poll_waits_out_its_timeout_then_reads_a_whole_message() -> None:
    ours, theirs = socket.socketpair()
    link = BlockingLink(ours)
    start = time.monotonic()
    assert link.poll(0.05) is False and time.monotonic() - start >= 0.04
    BlockingLink(theirs).send({"cmd": 1})
    assert link.poll(0.0) is True and link.recv() == {"cmd": 1}, "a zero timeout still reads what is there"
    theirs.close()
    with pytest.raises(LinkClosed):
        link.recv()
    ours.close()
