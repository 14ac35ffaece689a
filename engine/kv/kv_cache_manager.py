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

Sliding windows (``sliding_window``: the widest window, given only where every layer slides; a
model with any global layer, Gemma 3's, frees nothing here): a block whose every position lies
before ``num_computed - window + 1`` is read by no later query, so when the sequence next grows
(``allocate_slots``) those blocks go back to the pool (their hashes kept: a later prefix hit can
still revive them) and the table keeps :data:`FREED_BLOCK` in their place, as vLLM's
SlidingWindowManager keeps its null block. One block table serves every layer, so only blocks out
of every layer's window can go.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvfleet.engine.kv.block_hash import BlockHash, hash_block
from kvfleet.engine.kv.block_pool import BlockPool
from kvfleet.engine.sequence import Sequence


@dataclass(frozen=True)
class CachedPrefix:
    """A run of cached blocks that starts a sequence's tokens (possibly empty)."""

    block_ids: tuple[int, ...] = ()
    hashes: tuple[BlockHash, ...] = ()
    num_tokens: int = 0


@dataclass
class _SeqBlocks:
    hashes: list[BlockHash] = field(default_factory=list)  # hash chain of its computed full blocks
    in_flight: list[BlockHash] = field(default_factory=list)  # prompt blocks it registered as in flight
    num_freed: int = 0  # its first blocks, out of the window and back in the pool


NO_PREFIX = CachedPrefix()
FREED_BLOCK = 0  # in a block table where a block out of every layer's window was freed: read by nobody


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._seqs: dict[int, _SeqBlocks] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens served from the cache
        self.window_freed_blocks = 0  # blocks given back as out of every layer's window
        self._in_flight: dict[BlockHash, int] = {}  # prompt block being computed → the seq_id computing it

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def max_tokens_per_seq(self) -> int:
        """The most tokens one sequence can ever hold (the whole cache)."""
        return self.pool.num_blocks * self.block_size

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
        ids: list[int] = []
        hashes: list[BlockHash] = []
        for block_hash in self._chain(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            ids.append(block_id)
            hashes.append(block_hash)
        return CachedPrefix(tuple(ids), tuple(hashes), len(ids) * self.block_size)

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
        """
        chain = self._chain(seq, (seq.num_tokens - 1) // self.block_size)
        ids, hashes = list(cached.block_ids), list(cached.hashes)
        for i in range(len(cached.hashes), len(chain)):
            owner_id = self._in_flight.get(chain[i])
            entry = computing.get(owner_id) if owner_id is not None else None
            if entry is None or entry[0] is seq:
                break
            owner, computed_at_end = entry
            if (i + 1) * self.block_size > computed_at_end or i >= len(owner.block_ids):
                break  # the owner's chunk stops before this block ends: it is computed later
            ids.append(owner.block_ids[i])
            hashes.append(chain[i])
        return CachedPrefix(tuple(ids), tuple(hashes), len(ids) * self.block_size)

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
    # blocks; on failure (None) nothing changed.
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix | None = None
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (after a cached prefix, if given).

        Returns the ids of the newly allocated blocks (cache hits are not new), or None
        when the pool has too few free blocks. First frees the blocks that fell out of the window.
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
        num_computed = seq.num_computed_tokens + cached.num_tokens
        held = len(seq.block_ids) + len(cached.block_ids)
        num_new_blocks = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - held)
        num_revived = sum(1 for b in cached.block_ids if self.pool.is_free(b))
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(cached.block_ids)
        new_blocks = self.pool.allocate(num_new_blocks)
        assert new_blocks is not None  # checked above
        if not seq.block_ids:
            state = self._seqs[seq.seq_id] = self._seqs.get(seq.seq_id) or _SeqBlocks()
            self._count_lookup(seq, cached)
            state.hashes = list(cached.hashes)
            state.num_freed = 0
            seq.num_computed_tokens = cached.num_tokens
            seq.num_cached_tokens = cached.num_tokens
            self._unmark_in_flight(seq.seq_id, state.in_flight)
            state.in_flight = []
            self._mark_in_flight(seq, state, len(cached.hashes))
        seq.block_ids.extend(cached.block_ids)
        seq.block_ids.extend(new_blocks)
        return new_blocks

    # Invariant: the freed blocks are the first num_freed of the table, each registered in the
    # prefix cache first (with prefix caching on), and no query from num_computed_tokens on reads them.
    def _free_out_of_window(self, seq: Sequence) -> None:
        window, state = self.sliding_window, self._seqs.get(seq.seq_id)
        if window is None or state is None:
            return
        first_needed = seq.num_computed_tokens - window + 1  # the oldest key the next query reads
        upto = min(max(0, first_needed) // self.block_size, len(seq.block_ids))
        if self.enable_prefix_caching:
            upto = min(upto, len(state.hashes))
        if upto <= state.num_freed:
            return
        gone = seq.block_ids[state.num_freed : upto]
        self.pool.free(reversed(gone))
        seq.block_ids[state.num_freed : upto] = [FREED_BLOCK] * len(gone)
        state.num_freed = upto
        self.window_freed_blocks += len(gone)

    def freed_blocks(self, seq: Sequence) -> int:
        """How many of ``seq``'s first blocks were freed as out of the window."""
        state = self._seqs.get(seq.seq_id)
        return 0 if state is None else state.num_freed

    def _count_lookup(self, seq: Sequence, cached: CachedPrefix) -> None:
        if self.enable_prefix_caching and seq.num_computed_tokens == 0:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += cached.num_tokens

    # Invariant: after the call every full block below num_computed_tokens is registered
    # (unless another block already holds the same hash), in chain order.
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
        for i in range(len(state.hashes), num_full):
            self.pool.cache(seq.block_ids[i], chain[i])
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
        if self.freed_blocks(parent):  # its head is gone: the child computes its own
            num_shared = 0
        shared = parent.block_ids[:num_shared]
        self.pool.touch(shared)
        child.block_ids = list(shared)
        child.num_computed_tokens = num_shared * bs
        parent_state = self._seqs.get(parent.seq_id, _SeqBlocks())
        self._seqs[child.seq_id] = _SeqBlocks(list(parent_state.hashes[:num_shared]))
        return num_shared * bs

    # Invariant: the sequence's blocks join the free-queue tail last block first, so the
    # tail of a sequence is evicted before its (more shareable) head.
    def free(self, seq: Sequence) -> None:
        """Release all of the sequence's blocks; its KV is gone (num_computed_tokens = 0)."""
        state = self._seqs.pop(seq.seq_id, None)
        self.pool.free(reversed(seq.block_ids[0 if state is None else state.num_freed :]))
        seq.block_ids = []
        seq.num_computed_tokens = 0
        if state is not None:
            self._unmark_in_flight(seq.seq_id, state.in_flight)
