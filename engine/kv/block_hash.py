"""The prefix-cache key of one full KV block: a hash chain over the token ids of the prefix.

Where it sits: ``KVCacheManager`` hashes each full block of a sequence and asks the
``BlockPool`` whether a block with that hash is cached.

Invariant: ``hash_block(parent, tokens)`` depends on the parent block's hash and this
block's token ids only, so two sequences get equal hashes for block ``i`` exactly when
their first ``(i + 1) * block_size`` tokens are equal (up to SHA-256 collisions). The
hash is stable across processes (no ``PYTHONHASHSEED`` dependence).

A sequence's ``cache_namespace`` seeds the root of its chain: sequences in different
namespaces (another tenant's cache salt, another LoRA adapter) never share a block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_ROOT = b"kvfleet-kv-v1"


def cache_namespace(cache_salt: str | None = None, adapter: str | None = None) -> bytes:
    """The root seed of a sequence's hash chain; ``b""`` (the shared namespace) when both are None."""
    if cache_salt is None and adapter is None:
        return b""
    parts = (cache_salt or "", adapter or "")
    return b"".join(struct.pack("<I", len(p.encode())) + p.encode() for p in parts)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], namespace: bytes = b"") -> BlockHash:
    """The hash of a block after ``parent``; ``namespace`` counts only at the root (``parent`` None)."""
    digest = hashlib.sha256(parent if parent is not None else _ROOT + namespace)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return BlockHash(digest.digest())
