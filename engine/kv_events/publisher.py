"""The ZMQ publisher of KV event batches: a PUB socket, a ROUTER replay socket and their thread.

Where it sits: :class:`.collector.KVEventCollector` hands it one batch per step
(:meth:`ZmqEventPublisher.publish`: a queue put, nothing more on the step's path); the
thread encodes, numbers and sends them, and answers replay requests.

Invariant: sequence numbers go 0, 1, 2, ... in publish order, one per batch; the replay
buffer holds the last ``buffer_steps`` (seq, payload) pairs exactly as they were sent, so a
replay resends the same bytes under the same numbers.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from kvfleet.kv_events import END_SEQ, KVEventBatch, KVEventsConfig, encode_batch

log = logging.getLogger(__name__)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard and ipc/inproc endpoints are bound, the rest connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if _binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._next_seq = 0
        self.dropped = 0  # batches refused because the queue was full
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-publisher")
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch; a full queue drops it (counted), never blocks the step."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then close the sockets."""
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    log.exception("kv events: a replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            seq, payload = self._next_seq, encode_batch(batch)
            self._next_seq += 1
            self._buffer.append((seq, payload))  # replayable even if this send fails
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                log.exception("kv events: batch %d not sent (a subscriber can ask the replay socket)", seq)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: a replay request of %d frames ignored (want 3)", len(frames))
            return
        client, _empty, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
