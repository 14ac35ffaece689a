"""A step's inputs with two KV cache groups (engine/kv/groups.py: Gemma 3's full and sliding layers):
flatten_plan builds each group's block tables and slot mapping, the runner's step buffers give the
same batch, a tensor-parallel worker unpacks the same, and a layer of group 1 reads group 1's."""

from __future__ import annotations

import torch

from kvfleet.engine.model.batch import flatten_plan
from kvfleet.engine.parallel.step_inputs import pack, unpack
from kvfleet.engine.runner.step_buffers import StepBuffers
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import Sequence

BS = 4
CPU = torch.device("cpu")


def seq(prompt: int, outputs: list[int] | None = None) -> Sequence:
    ids = [(5 * i + 2) % 90 + 1 for i in range(prompt)]
    return Sequence("r", ids, SamplingParams(temperature=0.0), output_token_ids=outputs or [])


def plan() -> SchedulerPlan:
    # a decode at position 12 whose sliding table freed blocks 0 and 1 (0 in their place), and a prompt chunk
    return SchedulerPlan(
        scheduled=(
            ScheduledSeq(seq(10, [1, 2, 3]), 12, 1, (1, 2, 3, 4), ((0, 0, 7, 8),)),
            ScheduledSeq(seq(6), 0, 6, (10, 11), ((20, 21),)),
        )
    )


def test_each_group_gets_its_own_block_tables_and_slots() -> None:
    meta = flatten_plan(plan(), BS, CPU).meta
    assert meta.block_tables.tolist() == [[1, 2, 3, 4], [10, 11, 0, 0]]
    assert meta.slot_mapping.tolist() == [16, 40, 41, 42, 43, 44, 45]
    ((slots, tables),) = meta.kv_groups
    assert tables.tolist() == [[0, 0, 7, 8], [20, 21, 0, 0]] and tables.dtype == torch.int32
    assert slots.tolist() == [32, 80, 81, 82, 83, 84, 85]
    group1 = meta.for_kv_group(1)
    assert group1.block_tables is tables and group1.slot_mapping is slots and group1.kv_groups == ()
    assert meta.for_kv_group(0) is meta


def test_the_step_buffers_give_flatten_plans_group_tables() -> None:
    buffers = StepBuffers(8, 8, BS, null_block=99, device=CPU, max_tokens=32)
    got, want = buffers.fill_plan(plan()).meta, flatten_plan(plan(), BS, CPU).meta
    assert got.block_tables.tolist() == want.block_tables.tolist()
    assert [[t.tolist() for t in g] for g in got.kv_groups] == [
        [t.tolist() for t in g] for g in want.kv_groups
    ]


def test_a_worker_unpacks_the_same_group_tables() -> None:
    batch = flatten_plan(plan(), BS, CPU)
    header, flat = pack(batch, None, None)
    assert header.kv_groups == 1
    meta = unpack(header, flat).batch.meta
    ((slots, tables),) = meta.kv_groups
    ((want_slots, want_tables),) = batch.meta.kv_groups
    assert slots.tolist() == want_slots.tolist() and tables.tolist() == want_tables.tolist()
    assert meta.block_tables.tolist() == batch.meta.block_tables.tolist()
