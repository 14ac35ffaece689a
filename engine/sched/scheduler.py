"""Iteration-level (continuous) batching: which tokens of which sequences the next step computes.

Where it sits: ``Engine.step()`` calls ``Scheduler.schedule()`` for a
:class:`SchedulerPlan`, hands it to the runner, then gives the samples back to
``Scheduler.update()``. The scheduler owns the waiting queue and the running list and
asks the :class:`KVCacheManager` for blocks; the :class:`SchedulingPolicy` decides the
order, the step :class:`Budget` (engine/sched/budget.py, ``tokens`` or ``time``) how much a step
computes. It never touches tensors and never imports torch (docs/engine/scheduler-and-kv.md).

There is no prefill or decode phase: each running sequence has ``num_computed_tokens``
catching up with ``num_tokens``. A decode is a chunk of one token; a long prompt is cut
into chunks by the step budget, so chunked prefill and decodes share a step.

Every step is planned by one loop over the running sequences (:meth:`Scheduler._serve_running`;
only its :meth:`Scheduler._make_room` preempts), then one over the waiting ones
(:meth:`Scheduler._admit`, which never preempts), both spending the same step budget: the token
cap (``tokens``), or that and the step's predicted time, with decodes served first (``time``:
stall-free, the engine's default; ``--no-stall-free`` turns it off).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import NamedTuple

from kvfleet.engine.kv.kv_cache_manager import NO_PREFIX, CachedPrefix, KVCacheManager
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sched.budget import (
    MIN_PREFILL_CHUNK_TOKENS,
    Budget,
    BudgetLimits,
    StepBudget,
    default_budget_name,
    make_budget,
)
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sched.policy import SchedulingPolicy, make_policy
from kvfleet.engine.sched.step_cost import StepCostModel
from kvfleet.engine.sequence import Sequence, SequenceStatus

# A waiting sequence waits for another's in-flight prefix when at least this many of its
# tokens would otherwise be computed twice (SGLang's in-batch prefix threshold is 32 too).
SHARED_PREFIX_WAIT_TOKENS = 32


class Sampled(NamedTuple):
    seq: Sequence
    result: SampleResult


class Scheduler:
    """``budget``: a registered step budget's name (engine/sched/budget.py); None: ``time`` when
    ``target_step_s`` or ``decode_factor`` is given (stall-free), else ``tokens``."""

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: SchedulingPolicy | str = "fcfs",
        enable_chunked_prefill: bool = True,
        max_loras: int | None = None,
        target_step_s: float | None = None,
        decode_factor: float | None = None,
        step_cost: StepCostModel | None = None,
        min_prefill_chunk: int = MIN_PREFILL_CHUNK_TOKENS,
        budget: str | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras  # distinct LoRA adapters among running sequences; None: no adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._forks: dict[int, list[Sequence]] = {}  # parent seq_id → children waiting for its prompt KV
        self._requests: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0
        self._running_sorted = True  # False once an admission may have broken the policy order
        limits = BudgetLimits(
            max_num_batched_tokens,
            max_num_seqs,
            target_step_s,
            decode_factor,
            step_cost or StepCostModel(),
            min_prefill_chunk,
        )
        self.budget: Budget = make_budget(budget or default_budget_name(limits), limits)
        self.step_cost = limits.step_cost  # fed by Engine.step() when the budget learns it

    @property
    def stall_free(self) -> bool:
        """Whether steps are bounded by time (the ``time`` budget, whose cost model the engine feeds)."""
        return self.budget.learns_step_cost

    # ---- queue state
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(c) for c in self._forks.values())

    def add(self, seq: Sequence, forks: list[Sequence] | None = None) -> None:
        """Queue a sequence; ``forks`` (n > 1 siblings) join once its prompt KV is computed and shared."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._requests.setdefault(seq.request_id, []).append(seq)
        if forks:
            for child in forks:
                child.status = SequenceStatus.WAITING
            self._forks[seq.seq_id] = list(forks)
            self._requests[seq.request_id].extend(forks)

    # ---- planning
    def _order_running(self) -> None:
        """Put the running sequences back in policy order if an admission may have broken it."""
        if not self._running_sorted:
            self.policy.order_running(self.running)
            self._running_sorted = True

    def schedule(self) -> SchedulerPlan:
        """The next step: running sequences first, then admissions, in one step budget; a waiting
        sequence is admitted only when no running one had to be preempted this step."""
        self._order_running()
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        step = self.budget.open(self.running, self.waiting, scheduled)
        num_running_at_start = len(self.running)
        self._serve_running(step, scheduled, preempted)
        if not preempted and self.policy.may_admit(num_running_at_start):
            self._admit(step, scheduled)
        return SchedulerPlan(scheduled=tuple(scheduled), preempted=tuple(preempted))

    def _serve_running(
        self, step: StepBudget, scheduled: list[ScheduledSeq], preempted: list[Sequence]
    ) -> None:
        """The running sequences' next chunks in the step budget's order (policy order; decodes first
        under the time budget) until it is spent; one preempted meanwhile (:meth:`_make_room`) is skipped."""
        block_size, running = self.kv.block_size, SequenceStatus.RUNNING
        grant, spend, append = step.grant, step.spend, scheduled.append  # per sequence: bound once
        for seq in step.order:
            if seq.status is not running:
                continue  # preempted for a sequence served before it
            before, blocks = seq.num_computed_tokens, seq.block_ids
            cached = NO_PREFIX if blocks else self._cached_prefix(seq)
            before += cached.num_tokens
            num_new = grant(seq, before, len(seq.prompt_token_ids) + len(seq.output_token_ids) - before)
            if num_new == 0:
                break  # the step is full
            if blocks and before + num_new <= len(blocks) * block_size:
                # O(1) fast path (most decode steps): the chunk fits in the blocks already held.
                groups = tuple(map(tuple, seq.group_block_ids)) if seq.group_block_ids else ()
                entry: ScheduledSeq | None = ScheduledSeq(seq, before, num_new, tuple(blocks), groups)
            else:
                entry = self._make_room(seq, num_new, cached, scheduled, preempted)
            if entry is not None:
                spend(seq, before, num_new)
                append(entry)

    # Invariant: the one loop that preempts (admissions never do). A running sequence is preempted
    # only when the pool cannot give the next blocks to one being served, and the victim is the least
    # important running sequence (policy order) not yet in the plan: the one asking or one served after
    # it, never one whose chunk is planned; the one asking, once it is the victim, waits for a later step.
    def _make_room(
        self,
        seq: Sequence,
        num_new: int,
        cached: CachedPrefix,
        scheduled: list[ScheduledSeq],
        preempted: list[Sequence],
    ) -> ScheduledSeq | None:
        """Blocks for running ``seq``'s next chunk, preempting as stated above; None: ``seq`` was."""
        in_plan: set[int] | None = None
        while self.kv.allocate_slots(seq, num_new, cached) is None:
            in_plan = {e.seq.seq_id for e in scheduled} if in_plan is None else in_plan
            victim = next(s for s in reversed(self.running) if s.seq_id not in in_plan)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return None
        return self._entry(seq, num_new)

    def _admit(self, step: StepBudget, scheduled: list[ScheduledSeq]) -> None:
        """Move waiting sequences into the running list while the step budget, blocks and
        max_num_seqs allow; out of blocks, admissions stop (they never preempt).

        A sequence whose adapter would make more than ``max_loras`` distinct adapters run at once,
        or whose prefix another running sequence computes in a later step, waits (keeping its
        place) while the ones behind it may go; a prefix computed in this step is shared in it.
        """
        self.policy.order_waiting(self.waiting)
        adapters = self._running_adapters()
        held_back: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if adapters is not None and not self._adapter_fits(seq, adapters):
                held_back.append(self.waiting.popleft())
                continue
            if step.tokens_left == 0:
                if not self.policy.admits_whole_batch:
                    break
                self._start(seq)  # static batching: joins now, computes in later steps
                continue
            cached = self._share_in_flight(seq, self._cached_prefix(seq), scheduled)
            if cached is None:
                held_back.append(self.waiting.popleft())
                continue
            entry = self._admit_one(step, seq, cached, scheduled)
            if entry is None:
                break
            scheduled.append(entry)
        self.waiting.extendleft(reversed(held_back))

    def _admit_one(
        self, step: StepBudget, seq: Sequence, cached: CachedPrefix, scheduled: list[ScheduledSeq]
    ) -> ScheduledSeq | None:
        """Start the waiting sequence at the queue's head with its first chunk; None: the step has
        no room for it (tokens, time or blocks) and admissions stop."""
        before = seq.num_computed_tokens + cached.num_tokens
        wanted = seq.num_tokens - before
        whole = not self.enable_chunked_prefill
        if whole and wanted > step.tokens_left and scheduled:
            return None  # an unchunked prompt waits for a step with room for all of it
        num_new = step.grant(seq, before, wanted, whole=whole)
        if num_new == 0 or self.kv.allocate_slots(seq, num_new, cached) is None:
            return None
        step.spend(seq, before, num_new)
        self._start(seq)
        return self._entry(seq, num_new)

    def _share_in_flight(
        self, seq: Sequence, cached: CachedPrefix, scheduled: list[ScheduledSeq]
    ) -> CachedPrefix | None:
        """Where ``seq`` starts when other sequences are computing its prefix: None to wait.

        Blocks that this step computes are shared in this step (``kv.ride_in_flight``): ``seq``
        computes only its own tail, beside them. Blocks computed only in a later step (a chunk cut
        by the budget) are waited for, when there are at least SHARED_PREFIX_WAIT_TOKENS of
        them: computing them twice costs the step budget and everyone's TTFT; a short overlap
        (a chat template's first block) is computed again rather than waited for.
        """
        if self.policy.admits_whole_batch:
            return cached
        in_flight = self.kv.in_flight_tokens(seq, cached)
        if in_flight == 0:
            return cached
        computing = {e.seq.seq_id: (e.seq, e.context_len) for e in scheduled}
        riding = self.kv.ride_in_flight(seq, cached, computing)
        if riding.num_tokens - cached.num_tokens == in_flight:
            return riding
        return None if in_flight >= SHARED_PREFIX_WAIT_TOKENS else cached

    def _running_adapters(self) -> set[str] | None:
        if self.max_loras is None:
            return None
        return {s.lora_name for s in self.running if s.lora_name is not None}

    def _adapter_fits(self, seq: Sequence, adapters: set[str]) -> bool:
        """Whether seq may run beside the running adapters; if so its adapter joins them."""
        name = seq.lora_name
        if name is None or name in adapters:
            return True
        assert self.max_loras is not None
        if len(adapters) >= self.max_loras:
            return False
        adapters.add(name)
        return True

    def _start(self, seq: Sequence) -> None:
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._running_sorted = False

    def _cached_prefix(self, seq: Sequence) -> CachedPrefix:
        if seq.block_ids or seq.num_computed_tokens:
            return NO_PREFIX
        return self.kv.find_cached_prefix(seq)

    @staticmethod
    def _entry(seq: Sequence, num_new: int) -> ScheduledSeq:
        groups = tuple(map(tuple, seq.group_block_ids)) if seq.group_block_ids else ()
        return ScheduledSeq(seq, seq.num_computed_tokens, num_new, tuple(seq.block_ids), groups)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, queue at the front, start over from token 0 later."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- results
    def update(self, plan: SchedulerPlan, samples: Mapping[int, SampleResult]) -> list[Sampled]:
        """Advance each scheduled sequence past its chunk and append the tokens sampled for it."""
        sampled: list[Sampled] = []
        bs = self.kv.block_size
        running = SequenceStatus.RUNNING
        forks, get_sample = self._forks, samples.get
        for seq, before, num_new, _blocks, _groups in plan.scheduled:
            if seq.status is not running:
                continue  # aborted while the step ran
            seq.num_computed_tokens = after = before + num_new
            outputs = seq.output_token_ids
            if after == len(seq.prompt_token_ids) + len(outputs):  # entry.sample, inlined
                result = get_sample(seq.seq_id)
                if result is None:
                    raise RuntimeError(f"runner returned no sample for sequence {seq.seq_id}")
                outputs.append(result.token_id)
                sampled.append(Sampled(seq, result))
            if after // bs != before // bs:  # a block filled up this step: hash it, only now
                self.kv.cache_computed_blocks(seq)
            if forks:
                self._release_forks(seq)
        return sampled

    def _release_forks(self, parent: Sequence) -> None:
        children = self._forks.get(parent.seq_id)
        if children is None or parent.num_computed_tokens < parent.num_prompt_tokens:
            return
        del self._forks[parent.seq_id]
        for child in children:
            self.kv.fork(parent, child)
        self.waiting.extendleft(reversed(children))

    # ---- endings
    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the queues for good and free its blocks."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = status
        for child in self._forks.pop(seq.seq_id, []):
            self.finish(child, status)
        siblings = self._requests.get(seq.request_id, [])
        if all(s.is_finished for s in siblings):
            self._requests.pop(seq.request_id, None)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every unfinished sequence of the request; returns them (empty if unknown)."""
        seqs = [s for s in self._requests.get(request_id, []) if not s.is_finished]
        for seq in seqs:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs
