"""The start-up step cost profile (engine/core/step_profile.py): which synthetic steps it runs, what it feeds
the cost model, and that it leaves the KV pool and the served tokens as they were."""

from pathlib import Path

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.core.step_profile import (
    PROFILE_CONTEXT,
    REPEATS,
    TIME_BUDGET_S,
    WARMUP_STEPS,
    profile_step_cost,
)
from kvfleet.engine.kv.block_pool import BlockPool
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.sched.step_cost import StepCostModel, StepShape
from kvfleet.engine.testing.tiny import ensure_tiny_model

FIXED, PER_TOKEN, PER_ROW, PER_CONTEXT = 0.010, 1e-4, 1e-3, 1e-6  # the fake runner's exact step cost


class FakeRunner:
    """Advances a fake clock by a linear step cost (or a fixed ``step_s``) and records each plan."""

    def __init__(self, step_s: float | None = None) -> None:
        self.now = 0.0
        self.step_s = step_s
        self.plans: list[SchedulerPlan] = []

    @property
    def num_kv_blocks(self) -> int:
        return 64

    def clock(self) -> float:
        return self.now

    def execute(self, plan: SchedulerPlan) -> dict:  # type: ignore[type-arg]
        self.plans.append(plan)
        s = StepShape.of(plan.scheduled)
        cost = FIXED + PER_TOKEN * s.prefill_tokens + PER_ROW * s.decode_rows + PER_CONTEXT * s.context_tokens
        self.now += cost if self.step_s is None else self.step_s
        return {}


def run(runner: FakeRunner, pool: BlockPool, cost: StepCostModel, max_rows: int = 8, max_tokens: int = 2048):  # type: ignore[no-untyped-def]
    return profile_step_cost(
        runner, pool, 16, cost, max_rows=max_rows, max_tokens=max_tokens, vocab_size=100, clock=runner.clock
    )


def shapes(runner: FakeRunner) -> list[tuple[int, int, int]]:
    return [tuple(StepShape.of(p.scheduled).__dict__.values()) for p in runner.plans]  # type: ignore[misc]


def test_the_profile_runs_the_prompt_then_decode_batches_doubling_then_chunks_beside_decodes() -> None:
    runner, cost = FakeRunner(), StepCostModel()
    profile = run(runner, BlockPool(64), cost, max_rows=8)
    assert profile is not None
    c = PROFILE_CONTEXT
    expected = [(c, 0, c)] + [(0, 1, c)] * WARMUP_STEPS
    for rows in (1, 2, 4, 8):
        expected += [(0, rows, rows * c)] * REPEATS
    expected += [(0, 8, 8 * 32)] * REPEATS  # the short-context batch: rows told apart from context
    for chunk in (32, 128):
        for beside in (0, 1, 8):
            expected += [(chunk, beside, chunk + beside * c)] * REPEATS
    assert shapes(runner) == expected
    assert profile.steps == len(expected) - 1 - WARMUP_STEPS  # the prompt and the warm-up are not fed
    assert [rows for rows, _ in profile.decode_floor] == [1, 2, 4, 8]
    assert profile.decode_floor[-1][1] == pytest.approx(FIXED + 8 * PER_ROW + 8 * c * PER_CONTEXT)


def test_the_profile_gives_its_blocks_back_in_the_free_queue_order_it_found_them() -> None:
    pool = BlockPool(64)
    pool.allocate(3)  # a queue whose head is not block 0
    before = pool.free_block_ids()
    runner = FakeRunner()
    run(runner, pool, StepCostModel())
    every_table = {p.scheduled[0].block_ids for p in runner.plans}
    assert every_table == {tuple(before[-PROFILE_CONTEXT // 16 :])}  # the free queue's tail
    assert pool.free_block_ids() == before
    assert all(block.block_hash is None for block in pool.blocks)  # nothing hashed: no prefix-cache entry


def test_the_fit_learns_the_step_cost_before_any_request() -> None:
    cost = StepCostModel()
    run(FakeRunner(), BlockPool(64), cost, max_rows=64)
    fixed, per_token, per_row, per_context = cost.coefficients()
    assert fixed == pytest.approx(FIXED, rel=0.05)
    assert per_token == pytest.approx(PER_TOKEN, rel=0.05)
    assert per_row == pytest.approx(PER_ROW, rel=0.05)
    assert (
        cost.knows_prefill and cost.num_prefill_observed > 8
    )  # chunks sized by the fit from the first burst
    assert cost.marginal_prefill()[0] == pytest.approx(PER_TOKEN, rel=0.05)


def test_the_decode_floor_outlives_the_fits_forgetting() -> None:
    cost = StepCostModel()
    run(FakeRunner(), BlockPool(64), cost, max_rows=64)
    measured_64 = FIXED + 64 * PER_ROW + 64 * PROFILE_CONTEXT * PER_CONTEXT
    for i in range(2000):  # a long spell of 1-4 streams whose rows cost nothing: the fit forgets the rows
        rows = 1 + i % 4
        cost.observe(StepShape(0, rows, rows * 300), FIXED)
    assert cost.predict(0, 64, 64 * 300) < 0.8 * measured_64
    assert cost.predict_batch(64, 64 * 300) >= measured_64 * 0.999
    assert cost.decode_floor(128) > cost.decode_floor(64)  # extended past the last point by its slope


def test_no_new_shape_starts_past_the_time_budget() -> None:
    runner = FakeRunner(step_s=0.5)
    profile = run(runner, BlockPool(64), StepCostModel(), max_rows=64)
    assert profile is not None
    # prompt + warm-up: 2 s; rows 1 runs 3 steps (to 3.5 s); then nothing else starts
    assert len(runner.plans) == 1 + WARMUP_STEPS + REPEATS
    assert profile.seconds < TIME_BUDGET_S + REPEATS * 0.5 + 1e-9
    assert [rows for rows, _ in profile.decode_floor] == [1]


def test_no_kv_room_runs_nothing_and_the_cost_model_stays_empty() -> None:
    runner, cost = FakeRunner(), StepCostModel()
    assert run(runner, BlockPool(PROFILE_CONTEXT // 16 - 1), cost) is None
    assert runner.plans == [] and cost.num_observed == 0


def test_a_small_token_cap_chunks_the_prompt_and_keeps_every_step_within_it() -> None:
    runner = FakeRunner()
    run(runner, BlockPool(64), StepCostModel(), max_rows=64, max_tokens=64)
    assert max(p.num_batched_tokens for p in runner.plans) <= 64
    assert all(max(e.context_len for e in p.scheduled) <= 64 for p in runner.plans)


def test_the_decode_floor_is_piecewise_linear_and_refuses_bad_points() -> None:
    cost = StepCostModel()
    assert cost.decode_floor(4) == 0.0
    cost.set_decode_floor([(1, 0.010), (4, 0.016), (8, 0.020)])
    assert [cost.decode_floor(r) for r in (0.5, 1, 2, 4, 6, 8, 16)] == pytest.approx(
        [0.010, 0.010, 0.012, 0.016, 0.018, 0.020, 0.028]
    )
    with pytest.raises(ValueError, match="rows >= 1"):
        cost.set_decode_floor([(0, 0.01)])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("kvfleet-cache"))


def test_a_profiled_engine_serves_the_same_tokens_and_counts_no_prefix_lookup(tiny: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["hello world", "the", "kvfleet serves models on kubernetes"]
    outputs = {}
    for profiled in (True, False):
        llm = LLM(model=str(tiny), num_kv_blocks=128, stall_free=True, profile_step_cost=profiled)
        cost = llm.engine.scheduler.step_cost
        assert (cost.num_observed > 0) is profiled and (cost.decode_floor(1) > 0) is profiled
        assert llm.engine.kv.prefix_cache_queries == 0 and llm.engine.kv.num_free_blocks == 128
        outputs[profiled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]
