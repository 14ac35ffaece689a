"""A waiting sequence whose prefix another running sequence is computing waits for the cache hit.

Block size 4, so the wait threshold (32 tokens) is 8 blocks. Prompts are built from a shared
head and a private tail so exact block ids and chunk sizes can be asserted step by step.
"""

from kvfleet.engine.kv.kv_cache_manager import KVCacheManager
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.sched.scheduler import SHARED_PREFIX_WAIT_TOKENS, Scheduler
from kvfleet.engine.sequence import Sequence, SequenceStatus

HEAD = list(range(100, 140))  # 40 tokens: 10 full blocks of 4


def make(budget: int = 256, policy: str = "fcfs", num_blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size=4)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, policy=policy)


def add(s: Scheduler, rid: str, prompt: list[int], arrival: float) -> Sequence:
    seq = Sequence(rid, prompt, SamplingParams(), arrival_time=arrival)
    s.add(seq)
    return seq


def step(s: Scheduler) -> SchedulerPlan:
    plan = s.schedule()
    s.update(plan, {e.seq.seq_id: SampleResult(7) for e in plan.scheduled if e.sample})
    return plan


def summary(plan: SchedulerPlan) -> list[tuple[str, int, int]]:
    return [(e.seq.request_id, e.num_computed_before, e.num_new_tokens) for e in plan.scheduled]


def test_the_threshold_is_32_tokens() -> None:
    assert SHARED_PREFIX_WAIT_TOKENS == 32


def test_a_sequence_sharing_a_prefix_in_flight_waits_one_step_and_starts_from_the_hit() -> None:
    s = make()
    add(s, "a", HEAD + [1, 2, 3, 4, 5], arrival=0)
    b = add(s, "b", HEAD + [9, 9, 9], arrival=1)
    add(s, "c", [5] * 6, arrival=2)  # unrelated: goes ahead of b
    first = step(s)
    assert summary(first) == [("a", 0, 45), ("c", 0, 6)]
    assert [e.block_ids for e in first.scheduled] == [tuple(range(12)), (12, 13)]
    assert list(s.waiting) == [b]
    second = step(s)
    assert summary(second) == [("a", 45, 1), ("c", 6, 1), ("b", 40, 3)]
    assert second.scheduled[2].block_ids == (*range(10), 14)  # a's 10 head blocks, then its own
    assert b.num_cached_tokens == 40
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == (45 + 6 + 43, 40)


def test_once_fewer_than_32_shared_tokens_are_in_flight_it_starts_from_what_is_cached() -> None:
    s = make(budget=60)
    tail = list(range(500, 560))
    add(s, "a", HEAD + tail, arrival=0)  # 100 tokens: 60 this step, 40 the next
    b = add(s, "b", HEAD + tail[:30] + [2] * 10, arrival=1)  # shares a's first 70 tokens
    assert summary(step(s)) == [("a", 0, 60)]  # the budget is spent: b waits either way
    # 15 blocks cached; blocks 15-16 (8 of b's tokens) still in flight: under the threshold
    assert s.kv.in_flight_tokens(b, s.kv.find_cached_prefix(b)) == 8
    plan = step(s)
    assert summary(plan) == [("a", 60, 40), ("b", 60, 20)]
    assert b.num_cached_tokens == 60 and plan.scheduled[1].block_ids[:15] == tuple(range(15))


def test_when_the_sequence_computing_the_prefix_is_aborted_before_caching_it_the_other_computes_it() -> None:
    s = make()
    add(s, "a", HEAD + [1, 2, 3, 4, 5], arrival=0)
    b = add(s, "b", HEAD + [9, 9, 9], arrival=1)
    plan = s.schedule()
    assert summary(plan) == [("a", 0, 45)]  # b waits for a's head
    assert s.abort("a")  # before the step's results: nothing of a was cached
    assert summary(step(s)) == [("b", 0, 43)]
    assert b.num_cached_tokens == 0


def test_a_short_overlap_such_as_a_template_block_does_not_wait() -> None:
    s = make()
    add(s, "a", HEAD[:28] + [1] * 20, arrival=0)
    add(s, "b", HEAD[:28] + [2] * 20, arrival=1)  # 7 shared blocks: 28 tokens < 32
    assert summary(step(s)) == [("a", 0, 48), ("b", 0, 48)]


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


LONG = list(range(200, 280))  # 80 tokens: 20 full blocks of 4


def test_the_prompt_that_shares_the_most_goes_first_so_the_group_takes_two_steps_not_three() -> None:
    s = make()
    a = add(s, "a", LONG[:40] + [1] * 9, arrival=0)  # shares 10 blocks with b and c
    add(s, "b", LONG + [2] * 5, arrival=1)  # shares 20 blocks with c
    c = add(s, "c", LONG + [3] * 5, arrival=2)
    assert summary(step(s)) == [("b", 0, 85)]  # b leads; a and c wait for its blocks
    assert list(s.waiting) == [a, c]  # arrival order among the rest
    assert summary(step(s)) == [("b", 85, 1), ("a", 40, 9), ("c", 80, 5)]  # both from the cache


def test_arrival_order_stands_when_no_later_prompt_shares_32_tokens_more_than_the_head() -> None:
    s = make()
    add(s, "a", LONG[:48] + [1] * 9, arrival=0)  # shares 12 blocks with b and c
    add(s, "b", LONG[:76] + [2] * 9, arrival=1)  # shares 19 blocks with c: 7 more than a (28 tokens)
    add(s, "c", LONG[:76] + [3] * 9, arrival=2)
    assert summary(step(s)) == [("a", 0, 57)]


def test_a_lead_of_another_priority_or_another_prefix_does_not_jump_the_queue() -> None:
    s = make(policy="priority")
    add(s, "a", LONG[:40] + [1] * 9, arrival=0)
    b = Sequence("b", LONG + [2] * 5, SamplingParams(), arrival_time=1, priority=1)
    s.add(b)
    c = Sequence("c", LONG + [3] * 5, SamplingParams(), arrival_time=2, priority=1)
    s.add(c)
    add(s, "d", [7] * 12 + LONG, arrival=3)  # the same long run, after another first block
    assert summary(step(s)) == [("a", 0, 49), ("d", 0, 92)]  # b and c: lower priority, waiting for a
