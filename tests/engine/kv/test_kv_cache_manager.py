"""KVCacheManager: slots per chunk, prefix-cache hits over full blocks, forks, frees (block size 4)."""

from kvfleet.engine.kv.block_hash import cache_namespace
from kvfleet.engine.kv.kv_cache_manager import KVCacheManager
from kvfleet.engine.sequence import Sequence

from .steps import computed, seq


def prefilled(
    num_blocks: int, num_tokens: int, request_id: str, **options: bool
) -> tuple[KVCacheManager, Sequence]:
    """A manager of ``num_blocks`` 4-token blocks holding a prompt of tokens 0..num_tokens-1, allocated and computed."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, **options)
    s = seq(list(range(num_tokens)), request_id)
    kv.allocate_slots(s, num_tokens)
    computed(kv, s, num_tokens)
    return kv, s


def test_a_prompt_gets_exactly_the_blocks_its_tokens_need_and_decode_grows_one_block_at_a_time() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq(list(range(10)))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    computed(kv, a, 10)
    a.output_token_ids += [100, 101]  # 12 tokens: the 11th and 12th still fit in block 2
    assert kv.allocate_slots(a, 1) == []
    computed(kv, a, 11)
    assert kv.allocate_slots(a, 1) == []
    computed(kv, a, 12)
    a.output_token_ids.append(102)
    assert kv.allocate_slots(a, 1) == [3]
    assert a.block_ids == [0, 1, 2, 3]
    assert kv.num_free_blocks == 6


def test_a_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = seq(list(range(13)))
    assert kv.allocate_slots(a, 13) is None
    assert a.block_ids == [] and kv.num_free_blocks == 3 and kv.usage() == 0.0


def test_a_shared_prefix_is_served_from_the_cache_with_reference_counts_and_counted_in_tokens() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq(list(range(10)), "a")
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    computed(kv, a, 10)
    b = seq([*range(8), 50, 51, 52], "b")
    hit = kv.find_cached_prefix(b)
    assert (hit.block_ids, hit.num_tokens) == ((0, 1), 8)
    assert kv.allocate_slots(b, 3, hit) == [3]
    assert b.block_ids == [0, 1, 3]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (8, 8)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)


def test_a_hit_never_covers_the_whole_prompt_so_the_last_token_is_recomputed() -> None:
    kv, a = prefilled(10, 8, "a")
    same = seq(list(range(8)), "b")
    hit = kv.find_cached_prefix(same)
    assert (hit.block_ids, hit.num_tokens) == ((0,), 4)
    assert kv.allocate_slots(same, 4, hit) == [2]
    assert same.block_ids == [0, 2]


def test_blocks_are_cached_only_once_computed() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq(list(range(10)), "a")
    kv.allocate_slots(a, 10)  # allocated for the step, not yet computed
    assert kv.find_cached_prefix(seq(list(range(10)), "b")).num_tokens == 0
    computed(kv, a, 6)  # a chunk of 6: only block 0 is full and computed
    assert kv.find_cached_prefix(seq(list(range(10)), "b")).block_ids == (0,)


def test_free_returns_a_sequence_tail_first_so_its_tail_is_evicted_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = seq(list(range(12)), "a")
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    computed(kv, a, 12)
    kv.free(a)
    assert kv.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert (a.block_ids, a.num_computed_tokens) == ([], 0)
    other = seq([9] * 16, "o")
    assert kv.allocate_slots(other, 16) == [3, 4, 5, 2]  # evicts a's last block, keeps its first two
    b = seq(list(range(12)), "b")
    hit = kv.find_cached_prefix(b)
    assert (hit.block_ids, hit.num_tokens) == ((0, 1), 8)
    assert kv.allocate_slots(b, 4, hit) is None  # block 2 was evicted; no free block left for it
    assert kv.pool.free_block_ids() == [1, 0]


def test_freeing_one_of_two_sharers_keeps_the_shared_blocks_in_use() -> None:
    kv, a = prefilled(8, 9, "a")
    b = seq(list(range(9)), "b")
    assert kv.allocate_slots(b, 1, kv.find_cached_prefix(b)) == [3]
    assert b.block_ids == [0, 1, 3]
    kv.free(a)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 2]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 3)] == [1, 1, 1]
    kv.free(b)
    assert kv.usage() == 0.0


def test_a_fork_shares_the_full_prompt_blocks_before_the_last_prompt_token() -> None:
    kv, parent = prefilled(8, 10, "r", enable_prefix_caching=False)
    child = Sequence("r", parent.prompt_token_ids, parent.params, index=1)
    assert kv.fork(parent, child) == 8
    assert (child.block_ids, child.num_computed_tokens) == ([0, 1], 8)
    assert kv.allocate_slots(child, 2) == [3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)  # caching off: nothing looked up


def test_a_fork_of_a_block_aligned_prompt_recomputes_the_whole_last_block() -> None:
    kv, parent = prefilled(8, 8, "r")
    child = Sequence("r", parent.prompt_token_ids, parent.params, index=1)
    assert kv.fork(parent, child) == 4
    assert child.block_ids == [0]


def test_a_prefix_is_shared_only_within_its_cache_namespace() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = seq(list(range(10)), "a")
    a.cache_namespace = cache_namespace(cache_salt="tenant-a")
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    computed(kv, a, 10)
    other = seq(list(range(10)), "b")
    other.cache_namespace = cache_namespace(cache_salt="tenant-b")
    shared = seq(list(range(10)), "c")
    same = seq(list(range(10)), "d")
    same.cache_namespace = cache_namespace(cache_salt="tenant-a")
    assert kv.find_cached_prefix(other).block_ids == ()
    assert kv.find_cached_prefix(shared).block_ids == ()
    assert kv.find_cached_prefix(same).block_ids == (0, 1)


def test_a_salt_and_an_adapter_of_the_same_name_are_different_namespaces() -> None:
    assert cache_namespace() == b""
    assert cache_namespace(cache_salt="x") != cache_namespace(adapter="x")
    assert cache_namespace(cache_salt="x", adapter="y") != cache_namespace(cache_salt="xy")
