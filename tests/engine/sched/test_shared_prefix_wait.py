"""A waiting sequence whose prefix another sequence is computing shares those blocks.

Blocks computed in the step being planned are shared in that step: every layer stores all rows'
K/V before any row attends, so the sharer computes only its own tail beside them. Blocks
computed only in a later step are waited for (32 tokens or more) or computed again (fewer).
Block size 4, so the wait threshold (32 tokens) is 8 blocks. Prompts are built from a shared
head and a private tail so exact block ids and chunk sizes can be asserted step by step.
"""

from kvfleet.engine.kv.kv_cache_manager import KVCacheManager
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.scheduler import SHARED_PREFIX_WAIT_TOKENS, Scheduler
from kvfleet.engine.sequence import Sequence, SequenceStatus

from .stepping import step, summary

HEAD = list(range(100, 140))  # 40 tokens: 10 full blocks of 4
LONG = list(range(200, 280))  # 80 tokens: 20 full blocks of 4


def make(budget: int = 256, policy: str = "fcfs", num_blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size=4)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, policy=policy)


def add(s: Scheduler, rid: str, prompt: list[int], arrival: float) -> Sequence:
    seq = Sequence(rid, prompt, SamplingParams(), arrival_time=arrival)
    s.add(seq)
    return seq


def test_the_threshold_is_32_tokens() -> None:
    assert SHARED_PREFIX_WAIT_TOKENS == 32


def test_a_prefix_computed_in_this_step_is_shared_in_it_and_the_sharer_computes_only_its_tail() -> None:
    s = make()
    a = add(s, "a", HEAD + [1, 2, 3, 4, 5], arrival=0)
    b = add(s, "b", HEAD + [9, 9, 9], arrival=1)
    add(s, "c", [5] * 6, arrival=2)
    first = step(s)
    assert summary(first) == [("a", 0, 45), ("b", 40, 3), ("c", 0, 6)]
    assert [e.block_ids for e in first.scheduled] == [tuple(range(12)), (*range(10), 12), (13, 14)]
    assert b.num_cached_tokens == 40
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == (45 + 43 + 6, 40)
    assert summary(step(s)) == [("a", 45, 1), ("b", 43, 1), ("c", 6, 1)]
    s.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert not set(range(10)) & set(s.kv.pool.free_block_ids())  # b still holds a's head


def test_a_chain_of_shared_prefixes_is_computed_in_one_step() -> None:
    s = make()
    add(s, "a", LONG[:40] + [1] * 9, arrival=0)  # shares 10 blocks with b and c
    add(s, "b", LONG + [2] * 5, arrival=1)  # shares 20 blocks with c
    add(s, "c", LONG + [3] * 5, arrival=2)
    plan = step(s)
    assert summary(plan) == [("a", 0, 49), ("b", 40, 45), ("c", 80, 5)]
    a_blocks, b_blocks, c_blocks = (e.block_ids for e in plan.scheduled)
    assert b_blocks[:10] == a_blocks[:10] and c_blocks[:20] == b_blocks[:20]
    assert summary(step(s)) == [("a", 49, 1), ("b", 85, 1), ("c", 85, 1)]


def test_blocks_in_flight_that_this_step_computes_are_shared_even_under_the_threshold() -> None:
    s = make(budget=60)
    tail = list(range(500, 560))
    add(s, "a", HEAD + tail, arrival=0)  # 100 tokens: 60 this step, 40 the next
    b = add(s, "b", HEAD + tail[:30] + [2] * 10, arrival=1)  # shares a's first 70 tokens
    assert summary(step(s)) == [("a", 0, 60)]  # the budget is spent: b waits either way
    # 15 blocks cached; blocks 15-16 (8 of b's tokens) in flight, computed in a's next chunk
    assert s.kv.in_flight_tokens(b, s.kv.find_cached_prefix(b)) == 8
    plan = step(s)
    assert summary(plan) == [("a", 60, 40), ("b", 68, 12)]
    assert b.num_cached_tokens == 68 and plan.scheduled[1].block_ids[:17] == plan.scheduled[0].block_ids[:17]


def test_a_prefix_computed_only_in_a_later_step_is_waited_for_from_32_tokens_and_else_recomputed() -> None:
    s = make(budget=16)
    add(s, "a", LONG + [1, 2, 3, 4, 5], arrival=0)
    step(s)  # a: 16 of 85 computed (4 blocks cached); blocks 4-19 in flight, for a's later steps
    long_wait = Sequence("b", LONG + [9, 9, 9], SamplingParams())  # 16 blocks in flight: 64 tokens
    short_wait = Sequence("c", LONG[:24] + [8] * 8, SamplingParams())  # 2 blocks in flight: 8 tokens
    for seq, expected in ((long_wait, None), (short_wait, 16)):
        start = s._share_in_flight(seq, s.kv.find_cached_prefix(seq), scheduled=[])  # a not in the step
        assert (start if start is None else start.num_tokens) == expected


def test_when_the_sequence_computing_the_prefix_is_aborted_before_caching_it_the_other_computes_it() -> None:
    s = make(budget=16)
    add(s, "a", HEAD + [1, 2, 3, 4, 5], arrival=0)
    b = add(s, "b", HEAD + [9, 9, 9], arrival=1)
    plan = s.schedule()
    assert summary(plan) == [("a", 0, 16)]  # the budget is spent; b's head is in flight
    assert s.abort("a")  # before the step's results: nothing of a was cached
    assert summary(step(s)) == [("b", 0, 16)]
    assert b.num_cached_tokens == 0


def test_a_short_overlap_such_as_a_template_block_is_shared_in_the_step_too() -> None:
    s = make()
    add(s, "a", HEAD[:28] + [1] * 20, arrival=0)
    add(s, "b", HEAD[:28] + [2] * 20, arrival=1)  # 7 shared blocks: 28 tokens < 32
    assert summary(step(s)) == [("a", 0, 48), ("b", 28, 20)]


def test_the_blocks_an_aborted_sequence_computed_stay_a_hit_for_the_waiting_one() -> None:
    s = make(budget=16)
    add(s, "a", HEAD + [1, 2, 3, 4, 5], arrival=0)
    add(s, "b", HEAD + [9, 9, 9], arrival=1)
    assert summary(step(s)) == [("a", 0, 16)]
    assert s.abort("a")
    assert summary(step(s)) == [("b", 16, 16)]  # the 4 blocks a computed are a hit


def test_a_preempted_sequence_no_longer_holds_its_blocks_in_flight() -> None:
    s = make(budget=16)
    a = add(s, "a", HEAD + [1, 2, 3, 4, 5], arrival=0)
    step(s)
    s.running.remove(a)
    s.kv.free(a)
    b = add(s, "b", HEAD + [9, 9, 9], arrival=1)
    assert s.kv.in_flight_tokens(b, s.kv.find_cached_prefix(b)) == 0
    s.finish(a, SequenceStatus.FINISHED_ABORTED)


def test_the_static_policy_never_holds_a_sequence_back_for_a_shared_prefix() -> None:
    s = make(policy="static")
    add(s, "a", HEAD + [1], arrival=0)
    add(s, "b", HEAD + [2], arrival=1)
    assert summary(step(s)) == [("a", 0, 41), ("b", 0, 41)]


def test_different_cache_namespaces_never_wait_for_each_other() -> None:
    s = make()
    add(s, "a", HEAD + [1], arrival=0)
    b = Sequence("b", HEAD + [2], SamplingParams(), arrival_time=1, cache_namespace=b"tenant-b")
    s.add(b)
    assert summary(step(s)) == [("a", 0, 41), ("b", 0, 41)]
