"""BlockPool: exact block ids, free-queue order, reference counts and LRU eviction of cached blocks."""

import pytest

from kvfleet.engine.kv.block_hash import hash_block
from kvfleet.engine.kv.block_pool import BlockPool


def test_allocation_takes_block_ids_from_the_head_of_the_free_queue() -> None:
    pool = BlockPool(10)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.free_block_ids() == [5, 6, 7, 8, 9]
    assert [pool.blocks[i].ref_cnt for i in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.usage() == 0.5


def test_an_allocation_larger_than_the_free_queue_takes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.free_block_ids() == [3]


def test_freed_blocks_join_the_tail_in_the_order_given_and_are_reused_last() -> None:
    pool = BlockPool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([3, 1])
    assert pool.free_block_ids() == [4, 5, 3, 1]
    assert pool.allocate(3) == [4, 5, 3]


def test_a_shared_block_returns_to_the_free_queue_only_when_its_last_reference_goes() -> None:
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    pool.touch([0])
    assert pool.blocks[0].ref_cnt == 2
    pool.free([0])
    assert pool.free_block_ids() == [1, 2]
    pool.free([0])
    assert pool.free_block_ids() == [1, 2, 0]


def test_freeing_an_unreferenced_block_is_an_error_naming_the_block() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 1 freed more often"):
        pool.free([1])


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    h0, h1 = hash_block(None, [1, 2]), hash_block(None, [3, 4])
    assert pool.allocate(2) == [0, 1]
    assert pool.cache(0, h0) and pool.cache(1, h1)
    pool.free([1])
    pool.free([0])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.allocate(2) == [2, 3]
    assert (pool.lookup(h0), pool.lookup(h1)) == (0, 1)  # free but still cached
    assert pool.allocate(1) == [1]  # evicts h1, the least recently freed
    assert (pool.lookup(h0), pool.lookup(h1)) == (0, None)
    assert pool.blocks[1].block_hash is None


def test_touching_a_cached_free_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(3)
    h = hash_block(None, [7])
    assert pool.allocate(1) == [0]
    pool.cache(0, h)
    pool.free([0])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.touch([pool.lookup(h) or 0])
    assert pool.free_block_ids() == [1, 2]
    assert pool.blocks[0].ref_cnt == 1


def test_a_second_block_with_the_same_hash_is_not_cached() -> None:
    pool = BlockPool(2)
    h = hash_block(None, [5, 6])
    assert pool.allocate(2) == [0, 1]
    assert pool.cache(0, h) is True
    assert pool.cache(1, h) is False
    assert pool.lookup(h) == 0


def test_the_hash_chain_depends_on_the_parent_and_the_tokens_and_is_stable() -> None:
    a = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == a
    assert hash_block(a, [3, 4]) != hash_block(None, [3, 4])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert a.hex()[:16] == "d7608ad8fd87c1c6"  # SHA-256: the same in every process, whatever PYTHONHASHSEED
