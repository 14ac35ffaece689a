"""The scheduler over two KV cache groups (a full one and a sliding one of window 8, block size 4, one
pool of 8 blocks): a sequence is admitted only when its blocks fit in every group, a decode that needs
a block in each preempts the latest sequence, every plan entry carries each group's table, and the
sliding group's freed blocks let a waiting sequence in."""

from kvfleet.engine.kv.kv_cache_manager import FREED_BLOCK, KVCacheManager
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.scheduler import Scheduler
from kvfleet.engine.sequence import Sequence, SequenceStatus

from .stepping import step, summary


def make(num_blocks: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, group_windows=(None, 8))
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)


def add(s: Scheduler, rid: str, prompt_len: int, arrival: float) -> Sequence:
    seq = Sequence(
        rid, [ord(rid)] * prompt_len, SamplingParams(max_tokens=64, ignore_eos=True), arrival_time=arrival
    )
    s.add(seq)
    return seq


def test_admission_counts_blocks_in_every_group_and_plans_carry_each_groups_table() -> None:
    s = make()
    add(s, "a", 8, 0)
    add(s, "b", 8, 1)
    c = add(s, "c", 4, 2)
    plan = step(s)
    assert summary(plan) == [("a", 0, 8), ("b", 0, 8)]  # c's 1 + 1 blocks do not fit: it waits
    assert [(e.block_ids, e.group_block_ids) for e in plan.scheduled] == [
        ((0, 1), ((2, 3),)),
        ((4, 5), ((6, 7),)),
    ]
    assert c.status is SequenceStatus.WAITING and s.kv.num_free_blocks == 0


def test_a_decode_needing_a_block_in_each_group_preempts_the_latest_sequence() -> None:
    s = make()
    add(s, "a", 8, 0)
    b = add(s, "b", 8, 1)
    step(s)
    plan = step(s)  # a's 9th token needs a third block in both groups: b goes
    assert plan.preempted == (b,) and summary(plan) == [("a", 8, 1)]
    assert [(e.block_ids, e.group_block_ids) for e in plan.scheduled] == [((0, 1, 5), ((2, 3, 4),))]
    assert s.kv.pool.free_block_ids() == [7, 6]


def test_the_sliding_groups_freed_blocks_let_a_waiting_sequence_in() -> None:
    s = make(num_blocks=13)
    a = add(s, "a", 24, 0)
    step(s)  # a's whole prompt: 6 + 6 blocks, one left
    c = add(s, "c", 4, 1)
    plan = step(s)  # a's 25th token takes a 7th block in each group: first its sliding blocks 0..3 go
    assert s.kv.block_tables(a)[1][:5] == [FREED_BLOCK] * 4 + [10]
    assert summary(plan) == [("a", 24, 1), ("c", 0, 4)]  # 1 + 4 - 2 free: c's block in each group fits
    assert c.status is SequenceStatus.RUNNING and s.kv.block_tables(c) == [[8], [7]]
