"""KV cache groups (Gemma 3's interleaved sliding and global layers, vLLM's hybrid allocator): a full
group and a sliding group of window 8, block size 4, one pool. Exact block ids and free-queue order as
decoding advances, the sliding group's blocks reused by the next request, the prefix-hit rule across
groups, forks and frees."""

from kvfleet.engine.kv.groups import kv_layout
from kvfleet.engine.kv.kv_cache_manager import FREED_BLOCK, KVCacheManager
from kvfleet.engine.kv.prefix_rule import common_hit_blocks

from .steps import computed, decode, seq

F = FREED_BLOCK


def hybrid(num_blocks: int = 10, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, caching, group_windows=(None, 8))


def test_the_sliding_group_frees_its_blocks_as_decoding_advances_and_the_full_group_keeps_all() -> None:
    kv = hybrid()
    a = seq(list(range(10)))
    assert kv.allocate_slots(a, 10) == [0, 1, 2, 3, 4, 5]  # each group its own 3 blocks
    computed(kv, a, 10)
    assert kv.block_tables(a) == [[0, 1, 2], [3, 4, 5]]
    assert decode(kv, a, 100) == []  # position 10 reads keys 3..10: block 0 still read
    assert kv.block_tables(a) == [[0, 1, 2], [3, 4, 5]]
    assert decode(kv, a, 101) == []  # position 11 reads 4..11: the sliding group's block 0 goes
    assert kv.block_tables(a) == [[0, 1, 2], [F, 4, 5]] and kv.pool.free_block_ids() == [6, 7, 8, 9, 3]
    assert decode(kv, a, 102) == [6, 7]  # a new block in each group
    assert kv.block_tables(a) == [[0, 1, 2, 6], [F, 4, 5, 7]]
    for t in (103, 104):
        assert decode(kv, a, t) == []
    assert decode(kv, a, 105) == []  # position 15 reads 8..15: the sliding block 1 goes
    assert kv.block_tables(a) == [[0, 1, 2, 6], [F, F, 5, 7]]
    assert kv.pool.free_block_ids() == [8, 9, 3, 4]
    assert kv.freed_blocks(a, group=1) == 2 and kv.freed_blocks(a, group=0) == 0
    assert kv.window_freed_blocks == 2


def test_blocks_the_window_freed_serve_the_next_request() -> None:
    kv = hybrid(num_blocks=8)
    a = seq(list(range(10)), "a")
    kv.allocate_slots(a, 10)
    computed(kv, a, 10)
    for t in range(100, 106):
        decode(kv, a, t)  # frees the sliding group's blocks 3 and 4; takes 6 and 7
    assert kv.pool.free_block_ids() == [3, 4]
    assert kv.allocate_slots(seq([50, 51, 52, 53, 54], "b"), 5) is None  # 2 blocks in each group: 4
    b = seq([50, 51, 52, 53], "b")
    assert kv.allocate_slots(b, 4) == [3, 4]
    assert kv.block_tables(b) == [[3], [4]] and kv.num_free_blocks == 0


def test_a_sequence_needs_blocks_in_every_group_and_a_failed_allocation_changes_nothing() -> None:
    kv = hybrid(num_blocks=5)
    a = seq(list(range(10)), "a")
    assert kv.allocate_slots(a, 10) is None  # 3 blocks in each of 2 groups: 6 > 5
    assert kv.block_tables(a) == [[], []] and kv.num_free_blocks == 5
    assert kv.allocate_slots(a, 8) == [0, 1, 2, 3]
    assert kv.max_tokens_per_seq() == 8  # 5 blocks shared by 2 groups: 2 blocks of 4 tokens each


def test_freeing_gives_back_each_groups_held_blocks_last_block_first_group_by_group() -> None:
    kv = hybrid()
    a = seq(list(range(10)))
    kv.allocate_slots(a, 10)
    computed(kv, a, 10)
    for t in (100, 101):
        decode(kv, a, t)
    assert kv.block_tables(a) == [[0, 1, 2], [F, 4, 5]]
    kv.free(a)
    assert kv.pool.free_block_ids() == [6, 7, 8, 9, 3, 2, 1, 0, 5, 4]
    assert kv.block_tables(a) == [[], []] and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_a_long_shared_prompt_hits_all_full_blocks_and_only_the_sliding_blocks_in_its_window() -> None:
    kv = hybrid(num_blocks=20)
    a = seq(list(range(20)), "a")
    kv.allocate_slots(a, 20)
    computed(kv, a, 20)  # 5 full blocks in each group, all cached
    assert kv.block_tables(a) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    b = seq([*range(20), 70, 71, 72], "b")
    hit = kv.find_cached_prefix(b)
    # Resuming at token 20, b's queries read keys 13.. : sliding blocks 3 and 4 only.
    assert (hit.num_tokens, hit.block_ids, hit.group_block_ids) == (20, (0, 1, 2, 3, 4), ((F, F, F, 8, 9),))
    assert kv.allocate_slots(b, 3, hit) == [10, 11]
    assert kv.block_tables(b) == [[0, 1, 2, 3, 4, 10], [F, F, F, 8, 9, 11]]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 4, 5, 7, 8, 9)] == [2, 2, 1, 1, 2, 2]
    kv.free(b)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 4, 5, 8)] == [1, 1, 1, 1]  # the skipped ones untouched


def test_a_hit_needs_the_sliding_window_blocks_cached_too() -> None:
    """Block i cached for the full group (0) always; for the sliding group (1) only those listed."""

    def rule(sliding_cached: set[int], max_blocks: int = 6) -> int:
        cached = lambda g, i: g == 0 or i in sliding_cached  # noqa: E731
        return common_hit_blocks((None, 8), 4, max_blocks, cached)

    assert rule({0, 1, 2, 3, 4, 5}) == 6
    assert rule({4, 5}) == 6  # resuming at 24 reads keys 17..: blocks 4 and 5
    assert rule({0, 1, 2, 3, 5}) == 4  # block 4 gone: resume at 16, reading blocks 2 and 3
    assert rule({0, 5}) == 1  # only a hit of one block (its keys 0..3) reads blocks all cached
    assert rule(set()) == 0
    full_gone = lambda g, i: i < 3 if g == 0 else True  # noqa: E731
    assert common_hit_blocks((None, 8), 4, 6, full_gone) == 3


def test_a_hit_after_the_sliding_blocks_were_freed_and_evicted_falls_back_to_where_they_are_cached() -> None:
    kv = hybrid(num_blocks=12)
    a = seq(list(range(16)), "a")
    kv.allocate_slots(a, 16)
    computed(kv, a, 16)
    assert kv.block_tables(a) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    decode(kv, a, 100)  # position 16 reads 9..16: sliding blocks 0 and 1 go (kept cached, free)
    assert kv.block_tables(a)[1] == [F, F, 6, 7, 9]
    c = seq(list(range(200, 208)), "c")
    kv.allocate_slots(c, 8)  # takes 10, 11, then 5, 4 (freed last block first): their hashes evicted
    assert kv.block_tables(c) == [[10, 11], [5, 4]]
    assert kv.pool.lookup(a.block_hashes[0], 1) is None and kv.pool.lookup(a.block_hashes[0], 0) == 0
    b = seq([*range(16), 90], "b")
    assert kv.find_cached_prefix(b).num_tokens == 16  # blocks 2 and 3 of the sliding group still hit


def test_a_fork_shares_every_groups_prompt_blocks() -> None:
    kv = hybrid()
    parent = seq(list(range(9)), "p")
    kv.allocate_slots(parent, 9)
    computed(kv, parent, 9)
    child = seq(list(range(9)), "p")
    assert kv.fork(parent, child) == 8
    assert kv.block_tables(child) == [[0, 1], [3, 4]]
    assert [kv.pool.blocks[i].ref_cnt for i in range(6)] == [2, 2, 1, 2, 2, 1]


def test_one_group_per_attention_type_cut_to_the_fewest_layers_of_a_type() -> None:
    llama = kv_layout((), 4)
    assert (llama.windows, llama.tensor_of, llama.hybrid) == ((None,), (0, 1, 2, 3), False)
    gemma = kv_layout((8, 8, 8, 8, 8, None, 8, 8, 8, 8, 8, None), 12)
    assert gemma.windows == (None, 8, 8, 8, 8, 8)
    assert gemma.groups[0].layers == (5, 11) and gemma.groups[1].layers == (0, 1)
    assert gemma.num_tensors == 2 and gemma.tensor_of[:6] == (0, 1, 0, 1, 0, 0)
    uneven = kv_layout((6, None, 6, 6, 6), 5)
    assert [g.layers for g in uneven.groups] == [(1,), (0,), (2,), (3,), (4,)]
    assert kv_layout((6, 6), 2).windows == (6,)


def test_the_longest_sequence_counts_the_sliding_group_at_its_window_when_prompts_are_chunked() -> None:
    whole = KVCacheManager(40, 4, group_windows=(None, 8))
    assert whole.max_tokens_per_seq() == 20 * 4  # computed whole, the sliding group holds every block too
    chunked = KVCacheManager(40, 4, group_windows=(None, 8), max_chunk_tokens=8)
    # the sliding group holds at most ceil(7/4) + ceil(8/4) + 2 = 6 blocks: 34 are left for the full group
    assert chunked.max_tokens_per_seq() == 34 * 4
    assert KVCacheManager(40, 4, sliding_window=8, max_chunk_tokens=8).max_tokens_per_seq() == 160


def test_a_prompt_as_long_as_the_longest_fits_chunk_by_chunk() -> None:
    kv = KVCacheManager(12, 4, group_windows=(None, 8), max_chunk_tokens=8)
    longest = kv.max_tokens_per_seq()
    assert longest == 6 * 4  # full 6 + sliding min(6, 6): the bound is tight here
    kv = KVCacheManager(12, 4, group_windows=(None, 6), max_chunk_tokens=4)
    longest = kv.max_tokens_per_seq()
    a = seq(list(range(longest)))
    for start in range(0, longest, 4):
        assert kv.allocate_slots(a, 4) is not None, f"chunk at {start} of {longest}"
        computed(kv, a, start + 4)
    assert len(kv.block_tables(a)[0]) == longest // 4
