"""The router's subscription to every engine's KV events (vLLM's ZMQ wire, ``kvfleet/kv_events.py``).

Where it sits: one thread (:class:`KVEventSubscriber`) holds a SUB socket per engine and a DEALER
for its replay socket, checks each batch's sequence number and applies the batches, in order,
to the :class:`~kvfleet.router.kv_index.KVIndex` that the picker reads. Where each engine
publishes comes from the router's config (:func:`sources_for`: ``--kv-events URL=ENDPOINT[,REPLAY]``
per engine, or ``--kv-events-port P`` for every engine: ``tcp://<engine host>:P``, replay ``P+1``).

Invariant: for each engine the batches applied carry consecutive sequence numbers. On joining
(and on a first batch numbered past 0) the subscriber asks the replay socket for everything from
0; a later gap is asked for from the first missing number; what a replay cannot fill makes the
index forget the engine's entries (it may have missed removals), never apply out of order. A
batch numbered 0 after others, stamped later than the last applied, is a restarted engine: its
entries are forgotten first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import msgspec
import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfleet.kv_events import END_SEQ, decode_batch
from kvfleet.router.kv_index import KVIndex

if TYPE_CHECKING:
    from kvfleet.router.state import RouterState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventSource:
    """Where one engine publishes its KV events."""

    engine: str  # the engine's base URL, as discovery names it
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def parse_kv_events_entry(entry: str) -> EventSource:
    """``URL=ENDPOINT[,REPLAY]`` (``http://10.0.0.7:8000=tcp://10.0.0.7:5557,tcp://10.0.0.7:5558``)."""
    url, sep, rest = entry.rpartition("=")
    endpoint, _comma, replay = rest.partition(",")
    if not sep or "://" not in url or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(
            f"kv_events: {entry!r} is not URL=ENDPOINT[,REPLAY] with a tcp:// or ipc:// endpoint"
        )
    return EventSource(url.rstrip("/"), endpoint, replay or None)


def sources_for(
    engines: Iterable[str], explicit: Iterable[str] = (), port: int | None = None
) -> list[EventSource]:
    """Each engine's source: its explicit entry, else ``tcp://<its host>:port`` (replay ``port + 1``)."""
    named = {s.engine: s for s in map(parse_kv_events_entry, explicit)}
    out = []
    for url in engines:
        url = url.rstrip("/")
        if url in named:
            out.append(named[url])
        elif port is not None:
            host = urlsplit(url).hostname or "127.0.0.1"
            out.append(EventSource(url, f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"))
    return out


class KVEventSubscriber:
    def __init__(self, index: KVIndex, replay_timeout_s: float = 2.0) -> None:
        self.index = index
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._wanted: dict[str, EventSource] = {}
        self._subs: dict[str, tuple[EventSource, zmq.Socket[bytes]]] = {}
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_sources(self, sources: Iterable[EventSource]) -> None:
        """The engines to follow now (the thread connects and disconnects between polls)."""
        self._wanted = {s.engine: s for s in sources}
        self._changed.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-subscriber")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self) -> None:
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                if self._changed.is_set():
                    self._changed.clear()
                    self._resubscribe(poller)
                for sock, _ev in poller.poll(100):
                    engine = next(e for e, (_s, s) in self._subs.items() if s is sock)
                    frames = sock.recv_multipart()
                    try:
                        _topic, seq, payload = frames
                        self.handle(self._subs[engine][0], int.from_bytes(seq, "big"), payload)
                    except Exception:  # one engine's bad frame or replay must not stop the others' feeds
                        log.exception(
                            "kv events: %s: a batch could not be applied; its entries forgotten", engine
                        )
                        self.index.lost_events(engine)
        finally:
            for _source, sock in self._subs.values():
                sock.close(linger=0)

    def _resubscribe(self, poller: zmq.Poller) -> None:
        for engine in [e for e, (s, _) in self._subs.items() if self._wanted.get(e) != s]:
            _source, sock = self._subs.pop(engine)
            poller.unregister(sock)
            sock.close(linger=0)
            self.index.forget(engine)
        for engine, source in self._wanted.items():
            if engine in self._subs:
                continue
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt_string(zmq.SUBSCRIBE, source.topic)
            sock.connect(source.endpoint)
            poller.register(sock, zmq.POLLIN)
            self._subs[engine] = (source, sock)
            self.index.feed(engine)
            self._catch_up(source, 0)  # what it published before we joined, as far as its buffer goes

    # Invariant (the module's): applied batches are consecutive per engine.
    def handle(self, source: EventSource, seq: int, payload: bytes) -> None:
        """One live batch: applied in order, after what a gap before it needed from the replay socket."""
        feed = self.index.feed(source.engine)
        if feed.next_seq is not None and seq < feed.next_seq:
            if seq != 0 or not self._newer(payload, feed.last_ts):
                return  # already applied (it came in a replay)
            self.index.lost_events(source.engine)  # a restarted engine: its cache started empty
            feed.next_seq = None
        if feed.next_seq is None and seq > 0:
            self._catch_up(source, 0, until=seq)
        elif feed.next_seq is not None and seq > feed.next_seq:
            self._catch_up(source, feed.next_seq, until=seq)
        self._apply(source.engine, seq, payload)

    @staticmethod
    def _newer(payload: bytes, last_ts: float) -> bool:
        """A batch 0 stamped after the last one applied: its engine restarted (not a replay's duplicate)."""
        try:
            return decode_batch(payload).ts > last_ts
        except msgspec.DecodeError:
            return False

    def _catch_up(self, source: EventSource, start: int, until: int | None = None) -> None:
        feed = self.index.feed(source.engine)
        gap = feed.next_seq is not None
        if gap:
            self.index.replays += 1
        got = list(self._replay(source, start)) if source.replay_endpoint else []
        for seq, payload in got:
            if (until is None or seq < until) and (feed.next_seq is None or seq == feed.next_seq):
                self._apply(source.engine, seq, payload)
        if gap and until is not None and feed.next_seq != until:
            log.warning("kv events: %s: batches %d..%d lost", source.engine, start, until - 1)
            self.index.lost_events(source.engine)
            feed.next_seq = None

    def _apply(self, engine: str, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            log.warning("kv events: %s: batch %d undecodable (%s); its entries forgotten", engine, seq, exc)
            self.index.lost_events(engine)
            return
        self.index.apply(engine, batch)
        feed = self.index.feed(engine)
        feed.next_seq, feed.last_ts = seq + 1, batch.ts

    def _replay(self, source: EventSource, start: int) -> Iterator[tuple[int, bytes]]:
        """The replay socket's batches from ``start`` on, until its end marker or the timeout."""
        assert source.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(source.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(self.replay_timeout_ms):
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                yield int.from_bytes(frames[2], "big"), frames[3]
        finally:
            sock.close(linger=0)


class KVIndexCollector(Collector):
    """The index's figures as ``kvfleet_router_kv_index_*`` metrics, read at scrape time."""

    def __init__(self, index: KVIndex, busy: Callable[[str], bool]) -> None:
        self.index, self.busy = index, busy

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ix, p = self.index, "kvfleet_router_kv_index_"
        yield GaugeMetricFamily(p + "blocks", "Block entries in the KV index (all engines)", value=len(ix))
        yield GaugeMetricFamily(
            p + "bytes",
            "The KV index's estimated memory (entries x bytes per entry)",
            value=len(ix) * ix.bytes_per_block,
        )
        yield GaugeMetricFamily(
            p + "stale_engines", "Engines whose events stopped while busy", value=ix.stale_engines(self.busy)
        )
        for name, doc, value in (
            ("events", "KV events applied", ix.events),
            ("batches", "KV event batches applied", ix.batches),
            ("replays", "Gaps asked of an engine's replay socket", ix.replays),
            ("removed", "Block entries the engines removed", ix.removed),
            ("lost", "Gaps no replay filled (the engine's entries forgotten)", ix.lost),
            ("evicted", "Entries dropped by the index's LRU cap", ix.evicted),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)


async def follow_kv_events(state: RouterState, interval_s: float = 1.0) -> None:
    """The router's task: an index for the fleet, its metrics, and the subscription kept to the engines
    discovery knows (every ``interval_s``) until cancelled."""
    config, fleet = state.config, state.fleet
    index = KVIndex(config.kv_index_blocks, config.kv_events_stale_s)
    fleet.kv_index = index

    def busy(url: str) -> bool:
        engine = fleet.engines.get(url)
        return engine is not None and engine.in_flight > 0

    state.metrics.registry.register(KVIndexCollector(index, busy))
    subscriber = KVEventSubscriber(index)
    subscriber.start()
    try:
        while True:
            subscriber.set_sources(sources_for(list(fleet.engines), config.kv_events, config.kv_events_port))
            await asyncio.sleep(interval_s)
    finally:
        await asyncio.to_thread(subscriber.stop)
