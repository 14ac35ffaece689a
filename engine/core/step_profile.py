"""The step cost measured before serving: the runner's real step on synthetic plans, fed to the fit.

Where it sits: ``Engine.__init__`` calls :func:`profile_at_start` once its runner and scheduler are
built, when the scheduler plans stall-free (``engine/sched/step_cost.py``). Without it the cost
model starts knowing nothing: a burst's first chunks are the minimum, and a batch larger than the
recent steps ran is predicted from a per-row cost the fit never learnt (a cold engine hit by 32
prompts paid a decode step's fixed cost per 32-token chunk). With it, the fit starts from decode
batches of 1 to ``min(max_num_seqs, MAX_ROWS)`` rows and from chunks alone and beside decodes, and
the decode steps measured become the model's decode floor, which the forgetting fit never erases.

The plans are real ``SchedulerPlan`` s over one synthetic prompt of ``PROFILE_CONTEXT`` tokens whose
blocks are taken from the pool's free tail and given back unhashed: the free queue's order, the
prefix cache and its counters are as they were. Decode rows are distinct sequences recomputing the
prompt's last token over the same blocks (one slot, written with the same values). Every row is plain
greedy, so no sampler random state moves.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

from kvfleet.engine.kv.block_pool import BlockPool
from kvfleet.engine.kv.kv_cache_manager import KVCacheManager
from kvfleet.engine.runner.base import Runner
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sched.scheduler import Scheduler
from kvfleet.engine.sched.step_cost import StepCostModel, StepShape
from kvfleet.engine.sequence import Sequence

log = logging.getLogger(__name__)

PROFILE_CONTEXT = 256  # the synthetic prompt's tokens (the decode rows' context)
SHORT_CONTEXT = 32  # a second context for batches >= 8 rows, so the fit can tell rows from context
MAX_ROWS = 64  # decode batches double from 1 up to min(max_num_seqs, this)
CHUNKS = (32, 128)  # prefill chunks, alone and beside 1 and 8 decode rows
REPEATS = 3  # each shape runs this often; the median is the floor's point, every run feeds the fit
WARMUP_STEPS = 3  # 1-row steps first, unmeasured (lazy set-up, caches)
TIME_BUDGET_S = 3.0  # no new shape starts past this


class Profile(NamedTuple):
    steps: int  # steps run and fed to the fit, warm-up left out
    seconds: float
    decode_floor: tuple[tuple[int, float], ...]  # (rows, median s)


def profile_at_start(
    runner: Runner, kv: KVCacheManager, scheduler: Scheduler, max_model_len: int, vocab_size: int
) -> Profile | None:
    """Profile ``runner`` into ``scheduler``'s cost model; logs and returns what it ran."""
    profile = profile_step_cost(
        runner,
        kv.pool,
        kv.block_size,
        scheduler.step_cost,
        max_rows=scheduler.max_num_seqs,
        max_tokens=min(scheduler.max_num_batched_tokens, max_model_len),
        vocab_size=vocab_size,
    )
    if profile is None:
        log.info("step cost profile skipped: no free KV room for a %d-token prompt", PROFILE_CONTEXT)
        return None
    floor = ", ".join(f"{rows}: {s * 1e3:.1f} ms" for rows, s in profile.decode_floor)
    log.info("step cost profile (%d steps, %.1f s): decode %s", profile.steps, profile.seconds, floor)
    return profile


def profile_step_cost(
    runner: Runner,
    pool: BlockPool,
    block_size: int,
    cost: StepCostModel,
    *,
    max_rows: int,
    max_tokens: int,
    vocab_size: int,
    clock: Callable[[], float] = time.perf_counter,
) -> Profile | None:
    """Run the synthetic steps (module docstring); None, running nothing, when the pool lacks the
    prompt's blocks. ``max_tokens``: a step's token cap (and the context cap) the plans keep to."""
    context = max(2, min(PROFILE_CONTEXT, max_tokens))
    num_blocks = -(-context // block_size)
    free = pool.free_block_ids()
    if len(free) < num_blocks:
        return None
    blocks = tuple(free[-num_blocks:])
    pool.touch(blocks)  # out of the free queue; freed in the same order, they rejoin its tail as they were
    try:
        return _Run(runner, cost, blocks, context, vocab_size, clock).all(max_rows, max_tokens)
    finally:
        pool.free(blocks)


class _Run:
    def __init__(
        self,
        runner: Runner,
        cost: StepCostModel,
        blocks: tuple[int, ...],
        context: int,
        vocab_size: int,
        clock: Callable[[], float],
    ) -> None:
        self.runner, self.cost, self.blocks, self.clock = runner, cost, blocks, clock
        rng = random.Random(0)
        self.prompt = [rng.randrange(vocab_size) for _ in range(context)]
        self.params = SamplingParams(temperature=0.0, max_tokens=1)
        self.started = clock()
        self.steps = 0

    def all(self, max_rows: int, max_tokens: int) -> Profile:
        context = len(self.prompt)
        for start in range(0, context, max_tokens):  # the prompt's KV, so decode rows read real keys
            self._step([self._entry(start, min(max_tokens, context - start))], feed=False)
        for _ in range(WARMUP_STEPS):
            self._step(self._rows(1, context), feed=False)
        floor: list[tuple[int, float]] = []
        rows = 1
        while rows <= min(max_rows, MAX_ROWS, max_tokens) and self._in_time():
            floor.append((rows, self._median(self._rows(rows, context))))
            if rows >= 8:
                self._median(self._rows(rows, min(SHORT_CONTEXT, context)))
            rows *= 2
        for chunk in CHUNKS:
            for beside in (0, 1, 8):
                if (
                    chunk + beside <= max_tokens
                    and chunk < context
                    and beside <= max_rows
                    and self._in_time()
                ):
                    self._median([self._entry(0, chunk), *self._rows(beside, context)])
        self.cost.set_decode_floor(floor)
        return Profile(self.steps, self.clock() - self.started, tuple(floor))

    def _in_time(self) -> bool:
        return self.clock() - self.started < TIME_BUDGET_S

    def _entry(self, start: int, num_new: int, context: int | None = None) -> ScheduledSeq:
        """A sequence over the synthetic prompt (its first ``context`` tokens) computing ``num_new``
        tokens from ``start``."""
        prompt = self.prompt if context is None else self.prompt[:context]
        seq = Sequence("step-profile", prompt, self.params)
        return ScheduledSeq(seq, start, num_new, self.blocks)

    def _rows(self, rows: int, context: int) -> list[ScheduledSeq]:
        return [self._entry(context - 1, 1, context) for _ in range(rows)]

    def _median(self, scheduled: list[ScheduledSeq]) -> float:
        return statistics.median(self._step(scheduled) for _ in range(REPEATS))

    def _step(self, scheduled: list[ScheduledSeq], feed: bool = True) -> float:
        plan = SchedulerPlan(scheduled=tuple(scheduled))
        started = self.clock()
        self.runner.execute(plan)
        seconds = self.clock() - started
        if feed:
            self.cost.observe(StepShape.of(plan.scheduled), seconds)
            self.steps += 1
        return seconds
