"""The pool of fixed-size KV blocks: reference counts, the free queue and the prefix-cache map.

Where it sits: ``Scheduler`` → ``KVCacheManager`` → ``BlockPool``. The pool only counts
and orders block ids; the KV tensors themselves live in the runner, indexed by these ids.

A block is *free* when no sequence references it (``ref_cnt == 0``). A free block may
still be *cached*: it keeps its block hash, and a later sequence with the same prefix can
take it back out of the free queue instead of recomputing it. Allocation takes from the
head of the free queue and the frees go to its tail, so cached free blocks are evicted
least-recently-freed first (LRU).

With several KV cache groups (``engine/kv/groups.py``) the map is keyed by (hash, group): the same
tokens have the same hash in every group, but each group caches its own block for them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvfleet.engine.kv.block_hash import BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full, computed and cached
    cache_group: int = 0  # the KV cache group it is cached for


class BlockPool:
    """Hands out block ids from a free queue; keeps the ``block hash → block`` map of the prefix cache.

    Invariants: a block is in the free queue exactly when its ``ref_cnt`` is 0; a block is
    in the hash map exactly when its ``block_hash`` is set, and then it is the one block
    the map holds for that hash.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free queue: block id → None; head = next to allocate, tail = most recently freed.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[tuple[BlockHash, int], int] = {}
        # Observer (engine/kv_events): called ("stored", id, hash), ("removed", id, hash), ("cleared", None, None),
        # for KV cache group 0's blocks only (a hybrid model's other groups hold the same hashes: one event a block).
        self.on_event: Callable[[str, int | None, BlockHash | None], None] | None = None

    # ---- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue from head (allocated next) to tail."""
        return list(self._free)

    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: BlockHash, group: int = 0) -> int | None:
        """The cached block holding this hash for ``group``, free or in use, or None."""
        return self._cached.get((block_hash, group))

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # ---- mutations
    def allocate(self, num: int) -> list[int] | None:
        """Take ``num`` blocks from the head of the free queue (evicting their cached hashes).

        Returns None, taking nothing, when fewer than ``num`` blocks are free.
        """
        if num > len(self._free):
            return None
        taken: list[int] = []
        for _ in range(num):
            block_id, _none = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block_id)
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit or a fork); free ones leave the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given; blocks reaching 0 join the tail."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt < 1:
                raise ValueError(f"block {block_id} freed more often than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash, group: int = 0) -> bool:
        """Record a full, computed block of ``group`` under its hash; False if another block already holds it."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return block.block_hash == block_hash and block.cache_group == group
        if (block_hash, group) in self._cached:
            return False
        block.block_hash, block.cache_group = block_hash, group
        self._cached[(block_hash, group)] = block_id
        if self.on_event is not None and group == 0:
            self.on_event("stored", block_id, block_hash)
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.on_event is not None and block.cache_group == 0:
                self.on_event("removed", block.block_id, block.block_hash)
            del self._cached[(block.block_hash, block.cache_group)]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (vLLM's reset_prefix_cache); False, changing nothing, while a block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.on_event is not None:
            self.on_event("cleared", None, None)
        return True
