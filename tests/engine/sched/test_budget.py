"""Step budgets by name (engine/sched/budget.py): one planning loop spends whichever the scheduler holds.

Block size 4; the time budget's cost model has the binary-fraction prior of test_stall_free.py
(fixed 1/64 s, 1/1024 s per prefill token, 1/512 s per decode row), so chunks are exact.
"""

from collections import deque

import pytest

from kvfleet.engine.kv.kv_cache_manager import KVCacheManager
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched import budget as budgets
from kvfleet.engine.sched.budget import BudgetLimits, StepBudget, TokenBudget, make_budget
from kvfleet.engine.sched.plan import ScheduledSeq
from kvfleet.engine.sched.scheduler import Scheduler
from kvfleet.engine.sched.step_cost import StepCostModel
from kvfleet.engine.sequence import Sequence

from .stepping import step, summary

PRIOR = (2.0**-6, 2.0**-10, 2.0**-9, 0.0)


def make(num_blocks: int = 64, cap: int = 64, **kw: object) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=True)
    cost = StepCostModel(prior=PRIOR)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=cap, step_cost=cost, **kw)  # type: ignore[arg-type]


def add(s: Scheduler, rid: str, prompt_len: int, arrival: float) -> Sequence:
    seq = Sequence(
        rid, [sum(map(ord, rid)) * 100 + i for i in range(prompt_len)], SamplingParams(), arrival_time=arrival
    )
    s.add(seq)
    return seq


def test_without_a_time_bound_the_scheduler_holds_the_token_budget_and_serves_in_policy_order() -> None:
    s = make(cap=12)
    assert (s.budget.name, s.stall_free) == ("tokens", False)
    add(s, "a", 10, arrival=0)
    add(s, "b", 10, arrival=1)
    assert summary(step(s)) == [("a", 0, 10), ("b", 0, 2)]
    assert summary(step(s)) == [("a", 10, 1), ("b", 2, 8)]  # the cap, not the decode first
    assert summary(step(s)) == [("a", 11, 1), ("b", 10, 1)]


@pytest.mark.parametrize("bound", [{"target_step_s": 0.25}, {"decode_factor": 2.0}])
def test_a_target_or_a_decode_factor_selects_the_time_budget(bound: dict[str, float]) -> None:
    s = make(**bound)
    assert (s.budget.name, s.stall_free) == ("time", True)


def test_a_budget_named_is_built_and_an_unknown_name_is_rejected_with_the_known_ones() -> None:
    assert make(budget="time", decode_factor=2.0).budget.name == "time"
    with pytest.raises(ValueError, match="unknown budget 'joules'; known: time, tokens"):
        make(budget="joules")


def test_the_time_budget_needs_a_bound_and_the_token_budget_refuses_one() -> None:
    with pytest.raises(ValueError, match="'time' needs target_step_s, decode_factor or both"):
        make(budget="time")
    with pytest.raises(ValueError, match="'tokens' bounds tokens only"):
        make(budget="tokens", target_step_s=0.25)
    with pytest.raises(ValueError, match="decode_factor must be > 1, got 1.0"):
        make(decode_factor=1.0)


def test_a_token_step_budget_cuts_chunks_at_the_cap_but_grants_an_unchunked_prompt_whole() -> None:
    step_budget = make_budget("tokens", BudgetLimits(max_num_batched_tokens=8, max_num_seqs=4)).open(
        [], deque(), []
    )
    seq = Sequence("a", list(range(20)), SamplingParams())
    assert step_budget.grant(seq, 0, 20) == 8
    assert step_budget.grant(seq, 0, 20, whole=True) == 20
    step_budget.spend(seq, 0, 20)
    assert (step_budget.tokens_left, step_budget.grant(seq, 20, 1)) == (0, 0)


def test_the_time_budget_plans_decodes_first_then_the_chunk_the_time_left_allows() -> None:
    s = make(cap=512, target_step_s=0.125)
    add(s, "d", 4, arrival=1)
    assert summary(step(s)) == [("d", 0, 4)]  # no stream decodes yet: the cap alone
    add(s, "early", 300, arrival=0)  # ahead of d in policy order
    # one decode row: 1/64 + 1/512 s, leaving 0.125 - 0.017578125 s: 110 prefill tokens
    assert summary(step(s)) == [("d", 4, 1), ("early", 0, 110)]
    assert summary(step(s)) == [("d", 5, 1), ("early", 110, 110)]


def blocks_full(s: Scheduler) -> tuple[Sequence, Sequence]:
    """d1 and d2 decode next, each into a new block; early (ahead of both) holds a block with room
    for 2 more prompt tokens; the 3-block pool is full."""
    d1, d2 = add(s, "d1", 4, arrival=1), add(s, "d2", 4, arrival=2)
    add(s, "early", 12, arrival=0)
    assert summary(step(s)) == [("d1", 0, 4), ("d2", 0, 4), ("early", 0, 2)]
    assert s.kv.num_free_blocks == 0
    return d1, d2


def test_under_the_time_budget_a_decode_short_of_a_block_preempts_the_last_sequence_not_in_the_plan() -> None:
    s = make(num_blocks=3, cap=10, target_step_s=0.001, min_prefill_chunk=2)
    d1, d2 = blocks_full(s)
    plan = step(s)  # d1 first: d2 (last in policy order) gives its block; early's 2 fit in its own
    assert summary(plan) == [("d1", 4, 1), ("early", 2, 2)] and plan.preempted == (d2,)
    assert [e.block_ids for e in plan.scheduled] == [(0, 1), (2,)]
    assert list(s.waiting) == [d2] and s.num_preemptions == 1


def test_under_the_token_budget_the_prompt_ahead_preempts_both_streams_in_the_same_loop() -> None:
    s = make(num_blocks=3, cap=10)
    d1, d2 = blocks_full(s)
    plan = step(s)  # early first: 10 tokens need 2 more blocks, from d2 then d1
    assert summary(plan) == [("early", 2, 10)] and plan.preempted == (d2, d1)
    assert plan.scheduled[0].block_ids == (2, 1, 0)
    assert list(s.waiting) == [d1, d2] and s.num_preemptions == 2


def test_under_the_time_budget_a_decode_that_preempts_itself_leaves_the_step_to_the_prompt_ahead() -> None:
    s = make(num_blocks=2, cap=6, target_step_s=0.001, min_prefill_chunk=2)
    d1 = add(s, "d1", 4, arrival=1)
    add(s, "early", 12, arrival=0)
    assert summary(step(s)) == [("d1", 0, 4), ("early", 0, 2)]
    plan = step(s)  # d1 is the last in policy order: it gives its own block; no decode, the cap alone
    assert summary(plan) == [("early", 2, 6)] and plan.preempted == (d1,)
    assert plan.scheduled[0].block_ids == (1, 0)


class TwoTokensEach(StepBudget):
    def grant(self, seq: Sequence, computed: int, wanted: int, *, whole: bool = False) -> int:
        return min(2, super().grant(seq, computed, wanted, whole=whole))


class TwoTokensEachBudget(TokenBudget):
    name = "two_each"

    def open(
        self, running: list[Sequence], waiting: deque[Sequence], scheduled: list[ScheduledSeq]
    ) -> StepBudget:
        return TwoTokensEach(self.limits.max_num_batched_tokens, list(running))


def test_a_registered_budget_is_spent_by_the_same_loop_for_running_and_waiting_sequences(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(budgets, "_BUDGETS", dict(budgets._BUDGETS))
    budgets.register_budget(TwoTokensEachBudget.name, TwoTokensEachBudget)
    assert budgets.budget_names() == ["time", "tokens", "two_each"]
    s = make(budget="two_each")
    add(s, "a", 5, arrival=0)
    add(s, "b", 3, arrival=1)
    assert summary(step(s)) == [("a", 0, 2), ("b", 0, 2)]
    assert summary(step(s)) == [("a", 2, 2), ("b", 2, 1)]
    assert summary(step(s)) == [("a", 4, 1), ("b", 3, 1)]
