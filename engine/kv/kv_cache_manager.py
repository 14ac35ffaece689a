"""Which KV blocks each sequence holds: slot allocation, prefix-cache hits, forks and frees.

Where it sits: ``Scheduler.schedule()`` asks the :class:`KVCacheManager` for room for each
sequence's next chunk; the manager takes block ids from the :class:`BlockPool` and
appends them to ``seq.block_ids`` (the block table the runner reads). Nothing here
touches tensors.

Prefix caching: each full block whose KV has been computed is registered in the pool
under the hash chain of its prefix (``block_hash.hash_block``). A new sequence reuses the
longest run of cached blocks that starts its token ids, but never all of its tokens: the
last token is always recomputed so the step has logits to sample from. Blocks are
registered after the step that computed them (``cache_computed_blocks``), never at
allocation, so a hit always points at KV that is really in the cache. The
``prefix_cache_queries`` and ``prefix_cache_hits`` counters are in tokens, as in vLLM.

In flight: the prompt blocks a started sequence will compute but has not yet are indexed
by hash too, so the scheduler can see that a waiting sequence's prefix is being computed
right now by another one (``in_flight_tokens``) and let it wait for the hit instead of
computing the same KV a second time; when those blocks are computed in the step being planned,
it shares them in that step (``ride_in_flight``) and computes only its own tail.

Sliding windows and KV cache groups (``engine/kv/groups.py``): the manager keeps one block table
per group (``group_windows``, group 0's in ``seq.block_ids``, the others in ``seq.group_block_ids``),
all from one pool; a one-group manager (every Llama; ``sliding_window`` where every layer slides) is
today's one table. A block of a sliding group whose every position lies before
``num_computed - window + 1`` is read by no later query, so when the sequence next grows
(``allocate_slots``) those blocks go back to the pool (their hashes kept: a later prefix hit can
still revive them) and the table keeps :data:`FREED_BLOCK` in their place, as vLLM's
SlidingWindowManager keeps its null block; a full group frees nothing. A prefix hit of ``n`` blocks
must hold in every group: all ``n`` blocks of a full group, and in a sliding group only the last
``ceil((window - 1) / block_size)`` of them (the rest, read by nobody, stay :data:`FREED_BLOCK`),
vLLM's rule (``engine/kv/prefix_rule.py``). A sequence needs blocks in every group: admission and
preemption count them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvfleet.engine.kv.block_hash import BlockHash, hash_block
from kvfleet.engine.kv.block_pool import BlockPool
from kvfleet.engine.kv.prefix_rule import common_hit_blocks, skipped_blocks
from kvfleet.engine.sequence import Sequence


@dataclass(frozen=True)
class CachedPrefix:
    """A run of cached blocks that starts a sequence's tokens (possibly empty)."""

    block_ids: tuple[int, ...] = ()  # group 0's (its first num_skipped[0] are FREED_BLOCK)
    hashes: tuple[BlockHash, ...] = ()
    num_tokens: int = 0
    group_block_ids: tuple[tuple[int, ...], ...] = ()  # groups 1..'s, as block_ids
    num_skipped: tuple[int, ...] = ()  # per group: its first blocks out of the window (not held)


@dataclass
class _SeqBlocks:
    hashes: list[BlockHash] = field(default_factory=list)  # hash chain of its computed full blocks
    in_flight: list[BlockHash] = field(default_factory=list)  # prompt blocks it registered as in flight
    num_freed: list[int] = field(default_factory=list)  # per group: its first blocks, not held


NO_PREFIX = CachedPrefix()
FREED_BLOCK = 0  # in a block table where a block out of its group's window was freed: read by nobody


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tables(seq: Sequence) -> list[list[int]]:
    return [seq.block_ids, *seq.group_block_ids]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        group_windows: tuple[int | None, ...] | None = None,
        max_chunk_tokens: int | None = None,
    ) -> None:
        windows = (sliding_window,) if group_windows is None else group_windows
        if not windows:
            raise ValueError("group_windows must name at least one KV cache group")
        for window in windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
        self.group_windows = windows
        self._slides = any(w is not None for w in windows)  # some group frees blocks out of its window
        self.max_chunk_tokens = max_chunk_tokens  # a step's most tokens of one sequence (None: whole prompts)
        self.sliding_window = windows[0] if len(windows) == 1 else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._seqs: dict[int, _SeqBlocks] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens served from the cache
        self.window_freed_blocks = 0  # blocks given back as out of their group's window
        self._in_flight: dict[BlockHash, int] = {}  # prompt block being computed → the seq_id computing it

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    # Invariant: a sequence of the result's tokens, computed chunk by chunk, never holds more blocks
    # than the pool has: its full groups every block, each sliding group at most the blocks its window
    # reaches back from a chunk, and the chunk's own (all of them when prompts are computed whole).
    def max_tokens_per_seq(self) -> int:
        """The most tokens one sequence can ever hold (with one group, the whole cache)."""
        bs, total = self.block_size, self.pool.num_blocks
        if self.num_groups == 1:
            return total * bs
        chunk = self.max_chunk_tokens
        caps = [
            None if w is None or chunk is None else cdiv(w - 1, bs) + cdiv(chunk, bs) + 2
            for w in self.group_windows
        ]

        def needed(blocks: int) -> int:
            return sum(blocks if cap is None else min(blocks, cap) for cap in caps)

        lo, hi = 0, total  # needed(lo) <= total; the answer lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if needed(mid) <= total else (lo, mid - 1)
        return lo * bs

    def block_tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s block table in each group, group 0's first (empty ones before it starts)."""
        return [list(seq.block_ids), *(list(t) for t in seq.group_block_ids)] + [
            [] for _ in range(self.num_groups - 1 - len(seq.group_block_ids))
        ]

    def _chain(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hash chain of ``seq``'s first ``num_blocks`` full blocks (memoised on the sequence)."""
        chain = seq.block_hashes
        bs = self.block_size
        parent = BlockHash(chain[-1]) if chain else None
        for i in range(len(chain), num_blocks):
            parent = hash_block(parent, seq.tokens(i * bs, (i + 1) * bs), seq.cache_namespace)
            chain.append(parent)
        return [BlockHash(h) for h in chain[:num_blocks]]

    # Invariant: the result covers whole blocks only and at most num_tokens - 1 tokens.
    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest cached run of full blocks that starts ``seq``'s tokens; changes nothing."""
        if not self.enable_prefix_caching or seq.block_ids:
            return NO_PREFIX
        chain = self._chain(seq, (seq.num_tokens - 1) // self.block_size)
        if self.group_windows == (None,):  # one full-attention group: the longest run (hot path)
            ids: list[int] = []
            for block_hash in chain:
                block_id = self.pool.lookup(block_hash)
                if block_id is None:
                    break
                ids.append(block_id)
            return CachedPrefix(tuple(ids), tuple(chain[: len(ids)]), len(ids) * self.block_size)
        lookup = self.pool.lookup
        n = common_hit_blocks(
            self.group_windows, self.block_size, len(chain), lambda g, i: lookup(chain[i], g) is not None
        )
        skipped = tuple(skipped_blocks(w, n * self.block_size, self.block_size) for w in self.group_windows)
        tables = [
            (FREED_BLOCK,) * skip + tuple(lookup(h, g) or 0 for h in chain[skip:n])
            for g, skip in enumerate(skipped)
        ]
        return CachedPrefix(tables[0], tuple(chain[:n]), n * self.block_size, tuple(tables[1:]), skipped)

    def in_flight_tokens(self, seq: Sequence, cached: CachedPrefix) -> int:
        """Tokens right after ``cached`` whose blocks another started sequence is computing now."""
        if not self.enable_prefix_caching or not self._in_flight:
            return 0
        chain = self._chain(seq, (seq.num_tokens - 1) // self.block_size)
        run = 0
        for block_hash in chain[len(cached.hashes) :]:
            owner = self._in_flight.get(block_hash)
            if owner is None or owner == seq.seq_id:
                break
            run += 1
        return run * self.block_size

    def ride_in_flight(
        self, seq: Sequence, cached: CachedPrefix, computing: Mapping[int, tuple[Sequence, int]]
    ) -> CachedPrefix:
        """``cached`` extended by the in-flight blocks right after it that this very step computes.

        ``computing`` maps the seq_id of each sequence in the step being planned to the sequence
        and the token count it will have computed when the step ends. A block computed in the
        step can be shared in the step: every layer stores all rows' K/V before any row attends,
        so a sequence whose chunk starts after the shared blocks reads them as they are written.
        Every group shares the owner's block of that group.
        """
        chain = self._chain(seq, (seq.num_tokens - 1) // self.block_size)
        tables = [list(cached.block_ids), *(list(t) for t in cached.group_block_ids)]
        if not cached.hashes:
            tables = [[] for _ in self.group_windows]
        hashes = list(cached.hashes)
        for i in range(len(cached.hashes), len(chain)):
            owner_id = self._in_flight.get(chain[i])
            entry = computing.get(owner_id) if owner_id is not None else None
            if entry is None or entry[0] is seq:
                break
            owner, computed_at_end = entry
            if (i + 1) * self.block_size > computed_at_end or i >= len(owner.block_ids):
                break  # the owner's chunk stops before this block ends: it is computed later
            for table, owner_table in zip(tables, _tables(owner), strict=True):
                table.append(owner_table[i])
            hashes.append(chain[i])
        skipped = cached.num_skipped or (0,) * self.num_groups
        return CachedPrefix(
            tuple(tables[0]), tuple(hashes), len(hashes) * self.block_size,
            tuple(tuple(t) for t in tables[1:]), skipped,
        )  # fmt: skip

    def _mark_in_flight(self, seq: Sequence, state: _SeqBlocks, num_cached: int) -> None:
        """Index the full prompt blocks ``seq`` is about to compute (those after its cached prefix)."""
        if not self.enable_prefix_caching:
            return
        for block_hash in self._chain(seq, (seq.num_prompt_tokens - 1) // self.block_size)[num_cached:]:
            if self._in_flight.setdefault(block_hash, seq.seq_id) == seq.seq_id:
                state.in_flight.append(block_hash)

    def _unmark_in_flight(self, seq_id: int, hashes: list[BlockHash]) -> None:
        for block_hash in hashes:
            if self._in_flight.get(block_hash) == seq_id:
                del self._in_flight[block_hash]

    # Invariant: on success seq holds exactly cdiv(num_computed + num_new_tokens, block_size)
    # table entries in every group; on failure (None) nothing changed.
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix | None = None
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (after a cached prefix, if given).

        Returns the ids of the newly allocated blocks, group 0's first (cache hits are not new), or
        None when the pool has too few free blocks. First frees the blocks that fell out of a window.
        """
        self._free_out_of_window(seq)
        if cached is None or not cached.block_ids:
            # Fast path (most decode steps): the new tokens fit in the blocks already held.
            if (
                seq.block_ids
                and seq.num_computed_tokens + num_new_tokens <= len(seq.block_ids) * self.block_size
            ):
                return []
            cached = NO_PREFIX
        if cached.block_ids and (seq.block_ids or seq.num_computed_tokens):
            raise ValueError(f"sequence {seq.seq_id} already holds blocks; a cached prefix starts a sequence")
        groups = self.num_groups
        skipped = cached.num_skipped or (0,) * groups
        hits = [cached.block_ids, *cached.group_block_ids] if cached.block_ids else [()] * groups
        held_hits = [t[skip:] for t, skip in zip(hits, skipped, strict=True)]
        num_computed = seq.num_computed_tokens + cached.num_tokens
        held = len(seq.block_ids) + len(cached.block_ids)
        num_new_blocks = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - held)
        num_revived = sum(1 for t in held_hits for b in t if self.pool.is_free(b))
        if num_new_blocks * groups + num_revived > self.pool.num_free_blocks:
            return None
        all_new: list[int] = []
        if not seq.block_ids:
            self._start(seq, cached, skipped, len(hits))
        for table, hit, held_hit in zip(_tables(seq), hits, held_hits, strict=True):
            self.pool.touch(held_hit)
            new_blocks = self.pool.allocate(num_new_blocks)
            assert new_blocks is not None  # checked above
            table.extend(hit)
            table.extend(new_blocks)
            all_new.extend(new_blocks)
        return all_new

    def _start(self, seq: Sequence, cached: CachedPrefix, skipped: tuple[int, ...], groups: int) -> None:
        """A sequence's first allocation: its state, its counters, its prompt blocks in flight."""
        state = self._seqs[seq.seq_id] = self._seqs.get(seq.seq_id) or _SeqBlocks()
        self._count_lookup(seq, cached)
        state.hashes = list(cached.hashes)
        state.num_freed = list(skipped)
        seq.group_block_ids = [[] for _ in range(groups - 1)]
        seq.num_computed_tokens = cached.num_tokens
        seq.num_cached_tokens = cached.num_tokens
        self._unmark_in_flight(seq.seq_id, state.in_flight)
        state.in_flight = []
        self._mark_in_flight(seq, state, len(cached.hashes))

    # Invariant: the freed blocks are the first num_freed[g] of group g's table, each registered in
    # the prefix cache first (with prefix caching on), and no query from num_computed_tokens on reads them.
    def _free_out_of_window(self, seq: Sequence) -> None:
        state = self._seqs.get(seq.seq_id)
        if state is None or not self._slides:
            return
        for g, (window, table) in enumerate(zip(self.group_windows, _tables(seq), strict=True)):
            if window is None:
                continue
            upto = min(skipped_blocks(window, seq.num_computed_tokens, self.block_size), len(table))
            if self.enable_prefix_caching:
                upto = min(upto, len(state.hashes))
            if upto <= state.num_freed[g]:
                continue
            gone = table[state.num_freed[g] : upto]
            self.pool.free(reversed(gone))
            table[state.num_freed[g] : upto] = [FREED_BLOCK] * len(gone)
            state.num_freed[g] = upto
            self.window_freed_blocks += len(gone)

    def freed_blocks(self, seq: Sequence, group: int = 0) -> int:
        """How many of ``seq``'s first blocks of ``group`` are not held (out of the window)."""
        state = self._seqs.get(seq.seq_id)
        return 0 if state is None or not state.num_freed else state.num_freed[group]

    def _count_lookup(self, seq: Sequence, cached: CachedPrefix) -> None:
        if self.enable_prefix_caching and seq.num_computed_tokens == 0:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += cached.num_tokens

    # Invariant: after the call every full block below num_computed_tokens is registered in every
    # group (unless another block already holds the same hash there), in chain order.
    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_ids))
        if num_full <= len(state.hashes):
            return
        chain = self._chain(seq, num_full)
        tables = _tables(seq)
        for i in range(len(state.hashes), num_full):
            for g, table in enumerate(tables):
                self.pool.cache(table[i], chain[i], g)
            state.hashes.append(chain[i])
            if self._in_flight.get(chain[i]) == seq.seq_id:
                del self._in_flight[chain[i]]

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Share the parent's computed prompt blocks with a fresh child (n > 1 sampling).

        Shares the full blocks before the one holding the last prompt token, so the child
        recomputes at least that token (and writes only to blocks it owns). Returns the
        number of tokens shared.
        """
        if child.block_ids or child.num_computed_tokens:
            raise ValueError(f"sequence {child.seq_id} already holds blocks; only a fresh sequence forks")
        bs = self.block_size
        num_shared = min((parent.num_prompt_tokens - 1) // bs, parent.num_computed_tokens // bs)
        num_shared = min(num_shared, len(parent.block_ids))
        parent_state = self._seqs.get(parent.seq_id, _SeqBlocks())
        if any(parent_state.num_freed):  # its head is gone: the child computes its own
            num_shared = 0
        shared = [table[:num_shared] for table in _tables(parent)]
        for table in shared:
            self.pool.touch(table)
        child.block_ids = list(shared[0])
        child.group_block_ids = [list(t) for t in shared[1:]]
        child.num_computed_tokens = num_shared * bs
        self._seqs[child.seq_id] = _SeqBlocks(
            list(parent_state.hashes[:num_shared]), [], [0] * self.num_groups
        )
        return num_shared * bs

    # Invariant: each group's blocks join the free-queue tail last block first (group 0 first), so
    # the tail of a sequence is evicted before its (more shareable) head.
    def free(self, seq: Sequence) -> None:
        """Release all of the sequence's blocks; its KV is gone (num_computed_tokens = 0)."""
        state = self._seqs.pop(seq.seq_id, None)
        for g, table in enumerate(_tables(seq)):
            skip = state.num_freed[g] if state is not None and state.num_freed else 0
            self.pool.free(reversed(table[skip:]))
        seq.block_ids = []
        seq.group_block_ids = []
        seq.num_computed_tokens = 0
        if state is not None:
            self._unmark_in_flight(seq.seq_id, state.in_flight)
