"""The fleet's KV cache as one index: which engine holds which block hash, and in which medium.

Where it sits: :mod:`.kv_events_sub` feeds it every engine's KV event batches (kvfleet's and
vLLM's, ``kvfleet/kv_events.py``); :meth:`kvfleet.router.fleet.Fleet.candidates` asks it, for the
request's prompt hashed the way each engine hashes (``kvfleet/kv_hashing.py``), how long a
prefix each engine holds: the ``precise-prefix`` policy's prefix term (:mod:`.picker`).

Invariant: an entry ``(engine, hash)`` is in the index only if that engine published the hash
stored and, in every medium it was stored in, has not published it removed (nor cleared all)
since; so the index never claims more than the engine holds, except for the blocks it holds
beyond what was lost (a gap not replayed clears the engine's entries: it can only under-claim),
and for the entries of an engine gone stale (no batch for ``stale_after_s`` while it is busy),
which are not trusted: such an engine is scored as the approximate policy scores it.

Memory: one global LRU over all engines' entries, capped at ``max_blocks``; an entry costs
about :data:`BYTES_PER_BLOCK` (measured: a test holds it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvfleet.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvfleet.kv_hashing import kvfleet_block_hashes, vllm_block_hashes

BYTES_PER_BLOCK = (
    200  # a bound: an entry (OrderedDict slot, one int key) measured ~110 bytes at 20,000 entries
)
_MEDIA = {MEDIUM_GPU: 1, "CPU": 2}  # bit per medium; any other medium (STORAGE, ...) is bit 4
DEVICE = 1


def _bit(medium: str | None) -> int:
    return _MEDIA.get(medium or MEDIUM_GPU, 4)


@dataclass
class EngineFeed:
    """One engine's event stream as the index has followed it."""

    eid: int
    blocks: int = 0  # entries it has in the index
    next_seq: int | None = None  # the sequence number the next batch should carry
    last_batch_at: float | None = None
    last_ts: float = 0.0  # the engine's stamp on the last batch applied
    block_size: int | None = None  # as its BlockStored events say


@dataclass(frozen=True)
class Held:
    """How much of a prompt's leading blocks an engine holds: on the device, and in any tier."""

    device: int
    any_tier: int
    prompt_blocks: int

    @property
    def fraction(self) -> float:
        """Device blocks count whole, blocks only in a slower tier half (they must be copied back)."""
        if not self.prompt_blocks:
            return 0.0
        return (self.device + 0.5 * (self.any_tier - self.device)) / self.prompt_blocks


class KVIndex:
    def __init__(
        self,
        max_blocks: int = 1_000_000,
        stale_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_blocks = max_blocks
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, int] = OrderedDict()  # eid << 64 | hash → media bits, LRU first
        self.feeds: dict[str, EngineFeed] = {}
        self._eids = 0
        self.events = 0  # events applied
        self.batches = 0
        self.replays = 0  # gaps asked of a replay socket
        self.lost = 0  # gaps no replay could fill (the engine's entries cleared)
        self.evicted = 0  # entries dropped by the LRU cap
        self.removed = 0  # entries the engines removed
        self.bytes_per_block = BYTES_PER_BLOCK

    def feed(self, engine: str) -> EngineFeed:
        with self._lock:
            return self._feed(engine)

    def _feed(self, engine: str) -> EngineFeed:
        found = self.feeds.get(engine)
        if found is None:
            self._eids += 1
            found = self.feeds[engine] = EngineFeed(self._eids)
        return found

    def __len__(self) -> int:
        return len(self._entries)

    # ---- events in
    def apply(self, engine: str, batch: KVEventBatch) -> None:
        """One batch of ``engine``'s, in order (the subscriber has checked its sequence number)."""
        with self._lock:
            feed = self._feed(engine)
            feed.last_batch_at = self.clock()
            self.batches += 1
            for event in batch.events:
                self.events += 1
                if isinstance(event, BlockStored):
                    feed.block_size = event.block_size
                    self._store(feed, event.block_hashes, _bit(event.medium))
                elif isinstance(event, BlockRemoved):
                    self._remove(feed, event.block_hashes, _bit(event.medium))
                elif isinstance(event, AllBlocksCleared):
                    self._clear(feed)

    def _store(self, feed: EngineFeed, hashes: Sequence[int | bytes], bit: int) -> None:
        entries = self._entries
        for key in _keys(feed, hashes):
            had = entries.get(key)
            if had is None:
                entries[key] = bit
                feed.blocks += 1
            else:
                entries[key] = had | bit
                entries.move_to_end(key)
        while len(entries) > self.max_blocks:
            key, _bits = entries.popitem(last=False)
            self._owner(key >> 64).blocks -= 1
            self.evicted += 1

    def _remove(self, feed: EngineFeed, hashes: Sequence[int | bytes], bit: int) -> None:
        entries = self._entries
        for key in _keys(feed, hashes):
            had = entries.get(key)
            if had is None:
                continue
            if had & ~bit:
                entries[key] = had & ~bit
            else:
                del entries[key]
                feed.blocks -= 1
                self.removed += 1

    def _clear(self, feed: EngineFeed) -> None:
        eid = feed.eid
        for key in [k for k in self._entries if k >> 64 == eid]:
            del self._entries[key]
        feed.blocks = 0

    def _owner(self, eid: int) -> EngineFeed:
        return next(f for f in self.feeds.values() if f.eid == eid)

    def lost_events(self, engine: str) -> None:
        """A gap no replay could fill: forget what the engine holds (it may have removed any of it)."""
        with self._lock:
            self.lost += 1
            self._clear(self._feed(engine))

    def forget(self, engine: str) -> None:
        with self._lock:
            feed = self.feeds.pop(engine, None)
            if feed is not None:
                self._clear(feed)

    # ---- queries
    def blocks_of(self, engine: str) -> dict[int, int]:
        """The engine's entries: hash → media bits (tests compare them with the engine's pool)."""
        with self._lock:
            feed = self.feeds.get(engine)
            if feed is None:
                return {}
            mask = (1 << 64) - 1
            return {k & mask: bits for k, bits in self._entries.items() if k >> 64 == feed.eid}

    def is_stale(self, engine: str, busy: bool) -> bool:
        """Not to be trusted: never heard from, or silent for ``stale_after_s`` while it has work."""
        feed = self.feeds.get(engine)
        if feed is None or feed.last_batch_at is None:
            return busy or feed is None
        return busy and self.clock() - feed.last_batch_at > self.stale_after_s

    def stale_engines(self, busy: Callable[[str], bool]) -> int:
        return sum(1 for e in list(self.feeds) if self.is_stale(e, busy(e)))

    def held(self, engine: str, hashes: Sequence[int]) -> Held:
        """The leading ``hashes`` the engine holds (LRU-touched, as a hit is likely to follow)."""
        with self._lock:
            feed = self.feeds.get(engine)
            device = any_tier = 0
            if feed is not None:
                base, entries = feed.eid << 64, self._entries
                for h in hashes:
                    bits = entries.get(base | h)
                    if bits is None:
                        break
                    entries.move_to_end(base | h)
                    any_tier += 1
                    if bits & DEVICE and device == any_tier - 1:
                        device += 1
            return Held(device, any_tier, len(hashes))


def _keys(feed: EngineFeed, hashes: Sequence[int | bytes]) -> Iterator[int]:
    """The index's keys of ``hashes`` on ``feed``'s engine: the engine id above the 64-bit hash."""
    base = feed.eid << 64
    return (base | _as_int(h) for h in hashes)


def _as_int(h: int | bytes) -> int:
    """A published hash as the index keys it: ints as they are, bytes (a consumer of an engine
    with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) by their last 64 bits, as vLLM would have sent them."""
    return h if isinstance(h, int) else int.from_bytes(h, "big") & ((1 << 64) - 1)


@dataclass(frozen=True)
class PreciseQuery:
    """A request as the index is asked about it: the prompt's token ids (as the engine tokenizes it)
    and what namespaces its blocks (the cache salt it is sent with, the LoRA adapter it names)."""

    token_ids: tuple[int, ...]
    cache_salt: str | None = None
    adapter: str | None = None
    vllm_seed: str = "vllm-none-hash"

    def hashes(self, kind: str, block_size: int) -> list[int] | None:
        """The published hashes of the prompt's full blocks on an engine of ``kind``; None where the
        router cannot compute them (a LoRA request to vLLM: its key holds the adapter's path)."""
        if kind == "vllm":
            if self.adapter is not None:
                return None
            return vllm_block_hashes(self.token_ids, block_size, self.cache_salt, self.vllm_seed)
        return kvfleet_block_hashes(self.token_ids, block_size, self.cache_salt, self.adapter)
