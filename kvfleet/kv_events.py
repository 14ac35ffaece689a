"""KV cache events on the wire, as vLLM publishes them (``vllm/distributed/kv_events.py``, 0.32).

Where it sits: shared by both ends. The engine (``engine/kv_events/``) encodes a
:class:`KVEventBatch` per step and publishes it over ZMQ; the router
(``router/kv_events_sub.py``) decodes the same structs from kvfleet and vLLM engines alike.

Invariant: the structs below are field for field, in order, vLLM's msgspec structs, so a
batch encodes to the same msgpack bytes: the batch is an array ``[ts, events, dp_rank]``
(``array_like``), each event a map tagged by its class name (``tag=True``), fields left at
their defaults omitted. On the wire a batch is three ZMQ frames: topic, sequence number
(8 bytes, big-endian) and the payload. The replay socket (ROUTER) answers a request
``[b"", start_seq]`` with every buffered batch from ``start_seq`` on, then ``[b"", END_SEQ, b""]``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MEDIUM_GPU = "GPU"  # the device tier (vLLM's name, whatever the device: kvfleet on a CPU too)
MEDIUM_CPU = "CPU"  # a host-memory second tier
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end-of-stream marker

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch's payload frame; ``msgspec.DecodeError`` names what does not fit."""
    return _DECODER.decode(payload)


def external_hash(block_hash: bytes) -> int:
    """The hash a block is published under: its last 64 bits, big-endian, as vLLM's default
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) turns its bytes hashes into integers."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


class KVEventsConfig(BaseModel):
    """``--kv-events-config``: vLLM's ``KVEventsConfig``, field for field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(default=10_000, ge=1)
    hwm: int = Field(default=100_000, ge=0)
    max_queue_size: int = Field(default=100_000, ge=1)
    topic: str = ""

    @property
    def publishes(self) -> bool:
        kind = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and kind == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The flag's JSON; a ``ValueError`` naming the bad field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config: not JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config: a JSON object is needed")
    try:
        return KVEventsConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"--kv-events-config: {field}: {err['msg']}") from None


def kv_events_flag(text: str) -> KVEventsConfig:
    """``--kv-events-config`` for argparse: a bad value is the flag's own error."""
    import argparse

    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-events-config: ")) from None
