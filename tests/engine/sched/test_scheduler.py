"""Scheduler plans, step by step: budgets, chunked prefill, max_num_seqs, preemption, policies, abort."""

import pytest

from kvfleet.engine.kv.kv_cache_manager import KVCacheManager
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.sched.scheduler import Scheduler
from kvfleet.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8, **kw: object) -> Scheduler:
    caching = bool(kw.pop("prefix_caching", True))
    kv = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, **kw)  # type: ignore[arg-type]


def add(
    s: Scheduler, rid: str, prompt_len: int, *, arrival: float = 0.0, priority: int = 0, n: int = 1
) -> Sequence:
    params = SamplingParams(n=n)
    prompt = [ord(rid[0])] * prompt_len
    seqs = [Sequence(rid, prompt, params, index=i, arrival_time=arrival, priority=priority) for i in range(n)]
    s.add(seqs[0], forks=seqs[1:])
    return seqs[0]


def step(s: Scheduler) -> SchedulerPlan:
    plan = s.schedule()
    samples = {e.seq.seq_id: SampleResult(7) for e in plan.scheduled if e.sample}
    s.update(plan, samples)
    return plan


def summary(plan: SchedulerPlan) -> list[tuple[str, int, int]]:
    return [(e.seq.request_id, e.num_computed_before, e.num_new_tokens) for e in plan.scheduled]


def test_chunked_prefill_under_a_small_budget_shares_each_step_with_the_decodes() -> None:
    s = make(budget=8)
    add(s, "a", 3, arrival=0)
    add(s, "b", 3, arrival=1)
    add(s, "c", 20, arrival=2)
    assert summary(step(s)) == [("a", 0, 3), ("b", 0, 3), ("c", 0, 2)]
    assert summary(step(s)) == [("a", 3, 1), ("b", 3, 1), ("c", 2, 6)]
    assert summary(step(s)) == [("a", 4, 1), ("b", 4, 1), ("c", 8, 6)]
    plan = s.schedule()
    assert summary(plan) == [("a", 5, 1), ("b", 5, 1), ("c", 14, 6)]
    assert [e.sample for e in plan.scheduled] == [True, True, True]  # c's last chunk samples
    s.update(plan, {e.seq.seq_id: SampleResult(7) for e in plan.scheduled})
    assert summary(step(s)) == [("a", 6, 1), ("b", 6, 1), ("c", 20, 1)]


def test_a_middle_chunk_of_a_prompt_samples_nothing() -> None:
    s = make(budget=4)
    c = add(s, "c", 10)
    plan = s.schedule()
    assert summary(plan) == [("c", 0, 4)]
    s.update(plan, {})
    assert plan.scheduled[0].sample is False and c.output_token_ids == []
    assert plan.scheduled[0].block_ids == (0,)


def test_max_num_seqs_caps_the_running_batch_and_a_finish_makes_room() -> None:
    s = make(max_num_seqs=2)
    a = add(s, "a", 2, arrival=0)
    add(s, "b", 2, arrival=1)
    add(s, "c", 2, arrival=2)
    assert summary(step(s)) == [("a", 0, 2), ("b", 0, 2)]
    assert (s.num_running, s.num_waiting) == (2, 1)
    s.finish(a, SequenceStatus.FINISHED_LENGTH)
    assert summary(step(s)) == [("b", 2, 1), ("c", 0, 2)]


def test_out_of_blocks_preempts_the_latest_arrival_and_recomputes_it_later() -> None:
    s = make(num_blocks=4, prefix_caching=False)
    a = add(s, "a", 7, arrival=0)
    b = add(s, "b", 7, arrival=1)
    assert summary(step(s)) == [("a", 0, 7), ("b", 0, 7)]  # 2 blocks each: the pool is full
    assert summary(step(s)) == [("a", 7, 1), ("b", 7, 1)]  # token 8 still fits in block 2
    plan = step(s)  # a's 9th token needs a third block: b gives its two back
    assert summary(plan) == [("a", 8, 1)]
    assert plan.preempted == (b,)
    assert (b.status, b.num_computed_tokens, b.block_ids, b.num_preemptions) == (
        SequenceStatus.PREEMPTED,
        0,
        [],
        1,
    )
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    assert a.block_ids == [0, 1, 3]
    assert summary(step(s)) == [("a", 9, 1)]  # b (9 tokens = 3 blocks) does not fit beside a
    s.finish(a, SequenceStatus.FINISHED_LENGTH)
    plan = step(s)
    assert summary(plan) == [("b", 0, 9)]  # the recompute: prompt and both outputs, then a new sample
    assert plan.scheduled[0].block_ids == (2, 3, 1)
    assert b.output_token_ids == [7, 7, 7] and b.status is SequenceStatus.RUNNING


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_latest() -> None:
    s = make(num_blocks=3, prefix_caching=False)
    a = add(s, "a", 4, arrival=0)
    b = add(s, "b", 8, arrival=1)
    assert summary(step(s)) == [("a", 0, 4), ("b", 0, 8)]
    plan = step(s)  # a needs block 4 → b goes; a fits
    assert summary(plan) == [("a", 4, 1)] and plan.preempted == (b,)
    assert a.block_ids == [0, 2]


def test_the_priority_policy_admits_lower_values_first_then_earlier_arrivals() -> None:
    s = make(max_num_seqs=1, policy="priority")
    a = add(s, "a", 2, arrival=0, priority=5)
    b = add(s, "b", 2, arrival=1, priority=1)
    c = add(s, "c", 2, arrival=2, priority=1)
    assert summary(step(s)) == [("b", 0, 2)]
    s.finish(b, SequenceStatus.FINISHED_STOPPED)
    assert summary(step(s)) == [("c", 0, 2)]
    s.finish(c, SequenceStatus.FINISHED_STOPPED)
    assert summary(step(s)) == [("a", 0, 2)]
    assert a.status is SequenceStatus.RUNNING


def test_the_priority_policy_preempts_the_least_important_even_if_it_arrived_first() -> None:
    s = make(num_blocks=4, policy="priority", prefix_caching=False)
    low = add(s, "l", 7, arrival=0, priority=9)
    high = add(s, "h", 7, arrival=1, priority=0)
    assert summary(step(s)) == [("h", 0, 7), ("l", 0, 7)]
    step(s)
    plan = step(s)
    assert summary(plan) == [("h", 8, 1)] and plan.preempted == (low,)
    assert high.num_preemptions == 0


def test_the_fcfs_policy_ignores_priority() -> None:
    s = make(max_num_seqs=1, policy="fcfs")
    add(s, "a", 2, arrival=0, priority=5)
    add(s, "b", 2, arrival=1, priority=0)
    assert summary(step(s)) == [("a", 0, 2)]


def test_the_static_policy_admits_a_whole_batch_only_when_nothing_runs() -> None:
    s = make(budget=4, max_num_seqs=2, policy="static")
    a = add(s, "a", 4, arrival=0)
    b = add(s, "b", 4, arrival=1)
    add(s, "c", 1, arrival=2)
    assert summary(step(s)) == [("a", 0, 4)]  # b joins the batch, the budget starts it next step
    assert s.num_running == 2
    assert summary(step(s)) == [("a", 4, 1), ("b", 0, 3)]
    assert summary(step(s)) == [("a", 5, 1), ("b", 3, 1)]
    s.finish(a, SequenceStatus.FINISHED_LENGTH)
    assert summary(step(s)) == [("b", 4, 1)]  # c waits for the whole batch to finish
    s.finish(b, SequenceStatus.FINISHED_LENGTH)
    assert summary(step(s)) == [("c", 0, 1)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it() -> None:
    s = make(budget=6, enable_chunked_prefill=False)
    add(s, "a", 4, arrival=0)
    add(s, "b", 5, arrival=1)
    assert summary(step(s)) == [("a", 0, 4)]
    assert summary(step(s)) == [("a", 4, 1), ("b", 0, 5)]


def test_a_second_request_with_the_same_prompt_starts_after_the_cached_blocks() -> None:
    s = make()
    add(s, "a", 10, arrival=0)
    step(s)
    b = add(s, "a2", 10, arrival=1)  # same token ids: 'a' * 10
    plan = step(s)
    assert summary(plan) == [("a", 10, 1), ("a2", 8, 2)]
    assert plan.scheduled[1].block_ids == (0, 1, 3)
    assert b.num_cached_tokens == 8
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == (20, 8)


def test_n_samples_fork_from_the_first_once_its_prompt_is_computed() -> None:
    s = make(budget=64)
    parent = add(s, "r", 10, n=3)
    assert summary(step(s)) == [("r", 0, 10)]
    assert (s.num_waiting, len(s.waiting)) == (2, 2)  # forked and queued at the front
    plan = step(s)
    assert summary(plan) == [("r", 10, 1), ("r", 8, 2), ("r", 8, 2)]
    assert [e.block_ids for e in plan.scheduled] == [(0, 1, 2), (0, 1, 3), (0, 1, 4)]
    assert [s.kv.pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1]
    assert parent.output_token_ids == [7, 7]


def test_abort_frees_the_blocks_of_every_sequence_of_the_request() -> None:
    s = make()
    add(s, "a", 10, n=2)
    add(s, "b", 3)
    step(s)
    step(s)
    assert s.abort("a") and s.num_running == 1
    assert s.kv.num_free_blocks == 63
    assert s.abort("a") == [] and s.abort("nope") == []
    assert summary(step(s)) == [("b", 4, 1)]


def test_an_unknown_policy_name_is_rejected_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy 'lifo'; known: fcfs, priority, static"):
        make(policy="lifo")
