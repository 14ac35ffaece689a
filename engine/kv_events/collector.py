"""Collects the block pool's events during a step into one vLLM ``KVEventBatch`` per step.

Where it sits: :func:`attach` sets ``BlockPool.on_event`` (``engine/kv/block_pool.py``) and
``Engine.on_step_end`` (``engine/core/engine.py``); between the two it only appends to a list,
and at the step's end it hands the batch to the publisher's queue (:mod:`.publisher`), so
nothing is encoded or sent on the step's path.

Invariant: the events of a batch are in the pool's order; consecutive stores that continue
one sequence's chain (the next block's parent is the last stored hash) are one ``BlockStored``,
consecutive removals one ``BlockRemoved``, as vLLM batches them. A hit (a cached block taken
again) changes nothing in the pool and publishes nothing.

To know a stored block's tokens and parent, the collector wraps the KV cache manager's
``cache_computed_blocks(seq)`` on this engine instance (the one caller of ``BlockPool.cache``):
the sequence being registered is the one whose block was stored.
"""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING, Protocol

from kvfleet.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventsConfig,
    external_hash,
)

if TYPE_CHECKING:
    from kvfleet.engine.core.engine import Engine
    from kvfleet.engine.sequence import Sequence


class Publisher(Protocol):
    def publish(self, batch: KVEventBatch) -> None: ...


def split_namespace(namespace: bytes) -> tuple[str | None, str | None]:
    """``(cache_salt, adapter)`` back out of ``engine/kv/block_hash.cache_namespace``'s bytes."""
    if not namespace:
        return None, None
    parts: list[str] = []
    at = 0
    for _ in range(2):
        (size,) = struct.unpack_from("<I", namespace, at)
        parts.append(namespace[at + 4 : at + 4 + size].decode())
        at += 4 + size
    return parts[0] or None, parts[1] or None


class KVEventCollector:
    def __init__(self, publisher: Publisher, block_size: int, medium: str = MEDIUM_GPU) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.medium = medium
        self.pending: list[KVEvent] = []
        self._current: Sequence | None = None  # the sequence whose blocks are being registered
        self._last_stored: bytes | None = None
        self.num_events = 0

    def registering(self, seq: Sequence | None) -> None:
        self._current = seq

    def on_pool_event(self, kind: str, block_id: int | None, block_hash: bytes | None) -> None:
        if kind == "cleared":
            self.pending.append(AllBlocksCleared())
        elif kind == "removed" and block_hash is not None:
            last = self.pending[-1] if self.pending else None
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(external_hash(block_hash))
            else:
                self.pending.append(BlockRemoved([external_hash(block_hash)], self.medium))
        elif kind == "stored" and block_hash is not None:
            self._stored(block_hash)
            return
        self._last_stored = None

    def _stored(self, block_hash: bytes) -> None:
        seq, bs = self._current, self.block_size
        index = _index_in_chain(seq, block_hash)
        if seq is None or index is None:
            raise RuntimeError("kv events: a block was cached outside cache_computed_blocks")
        parent = bytes(seq.block_hashes[index - 1]) if index else None
        tokens = seq.tokens(index * bs, (index + 1) * bs)
        salt, adapter = split_namespace(seq.cache_namespace)
        keys = tuple(k for k in (adapter, salt if index == 0 else None) if k is not None) or None
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockStored) and parent is not None and parent == self._last_stored:
            last.block_hashes.append(external_hash(block_hash))
            last.token_ids.extend(tokens)
            last.extra_keys = _appended(last.extra_keys, len(last.block_hashes) - 1, keys)
        else:
            self.pending.append(
                BlockStored(
                    block_hashes=[external_hash(block_hash)],
                    parent_block_hash=None if parent is None else external_hash(parent),
                    token_ids=list(tokens),
                    block_size=bs,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=adapter,
                    extra_keys=None if keys is None else [keys],
                )
            )
        self._last_stored = block_hash

    def end_step(self) -> None:
        """The step is over: its events, if any, go to the publisher as one batch."""
        if not self.pending:
            return
        events, self.pending, self._last_stored = self.pending, [], None
        self.num_events += len(events)
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))


def _index_in_chain(seq: Sequence | None, block_hash: bytes) -> int | None:
    if seq is None:
        return None
    chain = seq.block_hashes
    for i in range(len(chain) - 1, -1, -1):
        if chain[i] == block_hash:
            return i
    return None


def _appended(
    keys: list[tuple[object, ...] | None] | None, before: int, new: tuple[object, ...] | None
) -> list[tuple[object, ...] | None] | None:
    """The per-block extra keys with one more block's (None stays None while every block's is None)."""
    if keys is None and new is None:
        return None
    return [*(keys if keys is not None else [None] * before), new]


def attach(
    engine: Engine, config: KVEventsConfig | None, publisher: Publisher | None = None
) -> KVEventCollector | None:
    """Publish ``engine``'s KV events as ``config`` says (or to ``publisher``); None when it says not to."""
    if publisher is None:
        if config is None or not config.publishes:
            return None
        from kvfleet.engine.kv_events.publisher import ZmqEventPublisher

        publisher = ZmqEventPublisher(config)
    kv = engine.kv
    collector = KVEventCollector(publisher, kv.block_size)
    register = kv.cache_computed_blocks

    def cache_computed_blocks(seq: Sequence) -> None:
        collector.registering(seq)
        try:
            register(seq)
        finally:
            collector.registering(None)

    kv.cache_computed_blocks = cache_computed_blocks  # type: ignore[method-assign]
    kv.pool.on_event = collector.on_pool_event
    engine.on_step_end = collector.end_step
    return collector
