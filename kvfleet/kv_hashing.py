"""The block hashes each engine kind keys its prefix cache by, computed outside the engine.

Where it sits: the router (``router/kv_index.py``) hashes a request's prompt tokens the way
the engine it scores will, to look them up among the hashes that engine published in its KV
events (``kvfleet/kv_events.py``). Torch-free: the router cannot import the engine.

* kvfleet: ``engine/kv/block_hash.py``'s chain (SHA-256 over the parent hash, or the root and
  the cache namespace, and the block's token ids as little-endian int64); a test holds the two equal.
* vLLM with ``--prefix-caching-hash-algo sha256_cbor``: ``sha256(cbor((parent, tokens, extra_keys)))``,
  canonical CBOR, the root's parent ``NONE_HASH = sha256(cbor(seed))`` with the seed
  ``PYTHONHASHSEED`` or ``"vllm-none-hash"``; extra keys ``(("cache_salt", salt),)`` on the
  first block only (``vllm/v1/core/kv_cache_utils.py``). vLLM's LoRA key holds the adapter's
  path, which the router does not know: LoRA requests to vLLM engines are not indexed.

Invariant: both chains give block ``i`` a hash that depends on the first ``(i + 1) * block_size``
tokens and the namespace only; events publish each hash as its last 64 bits (``external_hash``).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

from kvfleet.kv_events import external_hash

_KVFLEET_ROOT = b"kvfleet-kv-v1"
VLLM_DEFAULT_SEED = "vllm-none-hash"


def kvfleet_namespace(cache_salt: str | None = None, adapter: str | None = None) -> bytes:
    """``engine/kv/block_hash.cache_namespace``: the root seed of a sequence's chain."""
    if cache_salt is None and adapter is None:
        return b""
    parts = (cache_salt or "", adapter or "")
    return b"".join(struct.pack("<I", len(p.encode())) + p.encode() for p in parts)


def kvfleet_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, adapter: str | None = None
) -> list[int]:
    """The published (64-bit) hashes of the full blocks of ``token_ids`` on a kvfleet engine."""
    namespace = kvfleet_namespace(cache_salt, adapter)
    parent: bytes | None = None
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.sha256(parent if parent is not None else _KVFLEET_ROOT + namespace)
        digest.update(struct.pack(f"<{len(block)}q", *block))
        parent = digest.digest()
        out.append(external_hash(parent))
    return out


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | code]) + struct.pack(fmt, value)
    raise ValueError(f"integer {value} does not fit CBOR's 64 bits")


@functools.lru_cache(maxsize=1 << 17)
def _cbor_uint(value: int) -> bytes:
    """A token id's encoding, memoised: a prompt's ids repeat, and a vocabulary is bounded."""
    return _cbor_head(0, value)


def _cbor_tokens(token_ids: Sequence[int]) -> bytes:
    return _cbor_head(4, len(token_ids)) + b"".join(map(_cbor_uint, token_ids))


def cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2) of ints, str, bytes, None, bools and tuples/lists: what
    ``cbor2.dumps(value, canonical=True)`` writes for the values a block hash is made of."""
    if value is None:
        return b"\xf6"
    if value is True or value is False:
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (tuple, list)):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"no CBOR encoding here for {type(value).__name__}")


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


def vllm_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, seed: str = VLLM_DEFAULT_SEED
) -> list[int]:
    """The published hashes of the full blocks of ``token_ids`` on a vLLM engine started with
    ``--prefix-caching-hash-algo sha256_cbor`` (and ``PYTHONHASHSEED=seed``, if not the default)."""
    parent = sha256_cbor(seed)
    out: list[int] = []
    for i, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        block = _cbor_tokens(
            token_ids[start : start + block_size]
        )  # cbor((parent, tokens, extra)), spelt out
        parent = hashlib.sha256(b"\x83" + cbor(parent) + block + cbor(extra)).digest()
        out.append(external_hash(parent))
    return out
