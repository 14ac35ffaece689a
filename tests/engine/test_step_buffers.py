"""The one step input builder (engine/runner/step_buffers.py) against flatten_plan (engine/model/batch.py): any plan,
decode or mixed, one after the other in the same buffers, gives flatten_plan's batch; placeholders are
fed from the previous step's tokens on every route; the buffers grow for a larger step unless CUDA
graphs hold them."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.model.batch import FlatBatch, flatten_plan
from kvfleet.engine.runner import step_buffers
from kvfleet.engine.runner.step_buffers import StepBuffers
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import PLACEHOLDER_TOKEN, Sequence

BS = 4
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def seq(prompt: int, outputs: list[int] | None = None) -> Sequence:
    ids = [(7 * i + 3) % 97 + 1 for i in range(prompt)]
    return Sequence(request_id="r", prompt_token_ids=ids, params=GREEDY, output_token_ids=outputs or [])


def entry(s: Sequence, start: int, new: int, first_block: int) -> ScheduledSeq:
    blocks = tuple(range(first_block, first_block + (start + new - 1) // BS + 1))
    return ScheduledSeq(s, start, new, blocks)


def mixed() -> SchedulerPlan:
    return SchedulerPlan(
        scheduled=(
            entry(seq(6, [11, 12]), 7, 1, 0),  # a decode
            entry(seq(10), 0, 10, 10),  # a whole prompt
            entry(seq(14), 4, 5, 20),  # a chunk in the middle: samples nothing
            entry(seq(3, [9]), 3, 1, 30),  # a decode
        )
    )


def decodes() -> SchedulerPlan:
    return SchedulerPlan(scheduled=(entry(seq(9, [5]), 9, 1, 40), entry(seq(2), 1, 1, 50)))


def assert_same(got: FlatBatch, want: FlatBatch) -> None:
    for name in ("input_ids", "positions", "sample_rows"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    assert got.sample_seq_ids == want.sample_seq_ids
    for name in ("slot_mapping", "seq_lens", "query_start_loc", "block_tables"):
        assert getattr(got.meta, name).tolist() == getattr(want.meta, name).tolist(), name
        assert getattr(got.meta, name).dtype == getattr(want.meta, name).dtype, name
    assert (got.meta.max_query_len, got.meta.max_seq_len) == (want.meta.max_query_len, want.meta.max_seq_len)


def test_a_mixed_step_then_a_decode_step_then_the_mixed_again_each_give_flatten_plans_batch() -> None:
    buffers = StepBuffers(8, 8, BS, null_block=99, device=CPU, max_tokens=32)
    first, plan = mixed(), decodes()
    assert_same(buffers.fill_plan(first), flatten_plan(first, BS, CPU))
    buffers.fill(plan.scheduled, 4)
    want = flatten_plan(plan, BS, CPU)
    got = buffers.batch(2, want.meta.block_tables.shape[1], want.sample_seq_ids, want.meta.max_seq_len)
    assert_same(got, want)
    for again in (mixed(), decodes()):
        assert_same(buffers.fill_plan(again), flatten_plan(again, BS, CPU))


class Fed:
    def __init__(self, tokens: list[int], rows_of: dict[int, int]) -> None:
        self.tokens, self.rows_of = torch.tensor(tokens), rows_of


def test_a_placeholder_input_takes_the_previous_steps_token_on_the_unpadded_route_too() -> None:
    waiting = seq(5, [8, PLACEHOLDER_TOKEN])
    plan = SchedulerPlan(scheduled=(entry(seq(6), 0, 6, 0), entry(waiting, 6, 1, 10)))
    batch = StepBuffers(4, 8, BS, 0, CPU, max_tokens=16).fill_plan(plan, Fed([0, 0, 77], {waiting.seq_id: 2}))
    assert batch.input_ids.tolist() == seq(6).prompt_token_ids + [77]


def test_a_step_larger_than_the_buffers_grows_them_unless_graphs_hold_them() -> None:
    buffers, plan = StepBuffers(2, 2, BS, 0, CPU), mixed()
    assert_same(buffers.fill_plan(plan), flatten_plan(plan, BS, CPU))
    assert (buffers.layout.max_tokens, buffers.layout.max_seqs, buffers.layout.max_blocks) == (17, 4, 3)
    frozen = StepBuffers(2, 2, BS, 0, CPU)
    frozen.frozen = True
    with pytest.raises(ValueError, match="exceeds the step buffers"):
        frozen.fill_plan(mixed())


def test_a_plan_whose_blocks_cannot_hold_its_tokens_is_refused_as_flatten_plan_refuses_it() -> None:
    s = seq(9)
    plan = SchedulerPlan(scheduled=(ScheduledSeq(s, 0, 9, (0, 1)),))
    with pytest.raises(ValueError, match="2 blocks of 4 cannot hold 9 tokens"):
        StepBuffers(4, 4, BS, 0, CPU, max_tokens=16).fill_plan(plan)


@pytest.mark.parametrize("one_copy_bytes", [1 << 30, 0], ids=["one copy", "a copy per region"])
def test_a_separate_device_buffer_receives_every_region_a_step_reads(
    one_copy_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on CUDA (the CPU's device views are the host's): copied whole, or region by region."""
    monkeypatch.setattr(step_buffers, "ONE_COPY_BYTES", one_copy_bytes)
    buffers = StepBuffers(8, 8, BS, null_block=99, device=CPU, max_tokens=32)
    buffers._device = torch.zeros_like(buffers._host)
    buffers.dev = step_buffers._Views(buffers._device, buffers.layout)
    first, plan = mixed(), decodes()
    assert_same(buffers.fill_plan(first), flatten_plan(first, BS, CPU))
    buffers.fill(plan.scheduled, 2)
    want = flatten_plan(plan, BS, CPU)
    assert_same(buffers.batch(2, 3, want.sample_seq_ids, want.meta.max_seq_len), want)
