"""Iteration-level (continuous) batching: which tokens of which sequences the next step computes.

Where it sits: ``Engine.step()`` calls ``Scheduler.schedule()`` for a
:class:`SchedulerPlan`, hands it to the runner, then gives the samples back to
``Scheduler.update()``. The scheduler owns the waiting queue and the running list and
asks the :class:`KVCacheManager` for blocks; the :class:`SchedulingPolicy` decides the
order. It never touches tensors and never imports torch (docs/engine/scheduler-and-kv.md).

There is no prefill or decode phase: each running sequence has ``num_computed_tokens``
catching up with ``num_tokens``. A decode is a chunk of one token; a long prompt is cut
into chunks by the per-step token budget, so chunked prefill and decodes share a step.

Stall-free (``decode_factor`` and/or ``target_step_s``; the engine's default, ``--no-stall-free``
turns it off) the step is planned as in Sarathi-Serve: every running decode first, then prefill
chunks sized so that the step's predicted time (``step_cost.StepCostModel``, fitted online from the
engine's measured steps) stays within ``max(target_step_s, decode_factor × the decode step midway
to the batch the prompts make)`` (``step_cost.StepTimeBudget``); ``max_num_batched_tokens`` caps it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import NamedTuple

from kvfleet.engine.kv.kv_cache_manager import NO_PREFIX, CachedPrefix, KVCacheManager
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sched.policy import SchedulingPolicy, make_policy
from kvfleet.engine.sched.step_cost import StepCostModel, StepShape, StepTimeBudget
from kvfleet.engine.sequence import Sequence, SequenceStatus

# A waiting sequence waits for another's in-flight prefix when at least this many of its
# tokens would otherwise be computed twice (SGLang's in-batch prefix threshold is 32 too).
SHARED_PREFIX_WAIT_TOKENS = 32
# Under a step time target, the first prefill of every step gets at least this many tokens, so
# prompts progress even when the running decodes alone fill the target.
MIN_PREFILL_CHUNK_TOKENS = 32


class Sampled(NamedTuple):
    seq: Sequence
    result: SampleResult


class Scheduler:
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
        if target_step_s is not None and target_step_s <= 0:
            raise ValueError(f"target_step_s must be > 0, got {target_step_s}")
        if decode_factor is not None and decode_factor <= 1.0:
            raise ValueError(f"decode_factor must be > 1, got {decode_factor}")  # prefill gets factor - 1
        self.target_step_s = target_step_s  # a step may always take this long; None: no floor
        self.decode_factor = decode_factor  # a step may take this many decode-only steps; None: no scaling
        self.step_cost = step_cost or StepCostModel()  # fed by Engine.step() when stall-free
        self.min_prefill_chunk = min_prefill_chunk
        self._time: StepTimeBudget | None = None  # the step being planned's time left, stall-free mode

    @property
    def stall_free(self) -> bool:
        """Whether steps are planned stall-free (a time bound), rather than by the token cap alone."""
        return self.target_step_s is not None or self.decode_factor is not None

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

    # Invariant: running sequences are served before any waiting one, in policy order; the
    # step's tokens never exceed the budget; a waiting sequence is admitted only when no
    # running one had to be preempted this step.
    def schedule(self) -> SchedulerPlan:
        if self.stall_free:
            return self._schedule_stall_free()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        self._order_running()
        running, block_size = self.running, self.kv.block_size
        num_running_at_start = len(running)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed, blocks = seq.num_computed_tokens, seq.block_ids
            num_new = min(len(seq.prompt_token_ids) + len(seq.output_token_ids) - computed, budget)
            if blocks and computed + num_new <= len(blocks) * block_size:
                # O(1) fast path (most decode steps): the chunk fits in the blocks already held.
                entry: ScheduledSeq | None = ScheduledSeq(seq, computed, num_new, tuple(blocks))
            else:
                entry = self._schedule_running(i, budget, preempted)
            if entry is None:
                break
            scheduled.append(entry)
            budget -= entry.num_new_tokens
            i += 1
        if not preempted and self.policy.may_admit(num_running_at_start):
            budget = self._admit(budget, scheduled)
        return SchedulerPlan(scheduled=tuple(scheduled), preempted=tuple(preempted))

    # Invariant (stall-free): running decodes are planned before any prefill chunk, each group in policy
    # order; prefill (running prompts, then admissions) fills what the cap and the time bound leave, the
    # bound max(target, decode_factor x the decode step midway to the batch the decodes make with the
    # prompts running or waiting); a step's first prefill gets >= min_prefill_chunk; no decode: the cap.
    def _schedule_stall_free(self) -> SchedulerPlan:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        self._order_running()
        num_running_at_start = len(self.running)
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decoding:
            if budget == 0 or seq.status is not SequenceStatus.RUNNING:
                continue  # out of tokens, or preempted by a decode before it
            entry = self._room(seq, 1, NO_PREFIX, scheduled, preempted)
            if entry is None:
                break  # seq gave its own blocks up: everything after it is preempted too
            scheduled.append(entry)
            budget -= 1
        if scheduled:
            target_s, factor = self.target_step_s or 0.0, self.decode_factor or 0.0
            shape = StepShape.of(scheduled)
            full = shape.joined_by(self.max_num_seqs, prefilling, self.waiting)  # the decode step filled
            self._time = StepTimeBudget(self.step_cost, target_s, self.min_prefill_chunk, shape, factor, full)
        try:
            budget = self._prefill_running(prefilling, budget, scheduled, preempted)
            if not preempted and self.policy.may_admit(num_running_at_start):
                self._admit(budget, scheduled)
        finally:
            self._time = None
        return SchedulerPlan(scheduled=tuple(scheduled), preempted=tuple(preempted))

    def _prefill_running(
        self,
        prefilling: list[Sequence],
        budget: int,
        scheduled: list[ScheduledSeq],
        preempted: list[Sequence],
    ) -> int:
        """The next chunks of running prompts, in policy order, within the budget and the time left."""
        for seq in prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for a decode or an earlier prompt
            cached = self._cached_prefix(seq) if not seq.block_ids else NO_PREFIX
            before = seq.num_computed_tokens + cached.num_tokens
            num_new = min(seq.num_tokens - before, budget)
            if self._time is not None and (num_new := self._time.chunk(before, num_new)) == 0:
                break
            entry = self._room(seq, num_new, cached, scheduled, preempted)
            if entry is None:
                break
            if self._time is not None:
                self._time.spend(before, num_new)
            scheduled.append(entry)
            budget -= num_new
        return budget

    def _room(
        self,
        seq: Sequence,
        num_new: int,
        cached: CachedPrefix,
        scheduled: list[ScheduledSeq],
        preempted: list[Sequence],
    ) -> ScheduledSeq | None:
        """Blocks for running ``seq``'s next chunk; out of blocks, the lowest-priority running sequence
        not yet in this step's plan is preempted, until it fits or ``seq`` itself goes (None)."""
        in_plan: set[int] | None = None
        while self.kv.allocate_slots(seq, num_new, cached) is None:
            in_plan = {e.seq.seq_id for e in scheduled} if in_plan is None else in_plan
            victim = next(s for s in reversed(self.running) if s.seq_id not in in_plan)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return None
        return self._entry(seq, num_new)

    def _schedule_running(self, i: int, budget: int, preempted: list[Sequence]) -> ScheduledSeq | None:
        """Room for running[i]'s next chunk, preempting from the back of the running list if needed."""
        seq = self.running[i]
        cached = self._cached_prefix(seq) if not seq.block_ids else NO_PREFIX
        num_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        num_new = min(num_tokens - seq.num_computed_tokens - cached.num_tokens, budget)
        while self.kv.allocate_slots(seq, num_new, cached) is None:
            victim = self.running[-1]  # lowest priority, latest arrival (running is in policy order)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return None
        return self._entry(seq, num_new)

    def _admit(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        """Move waiting sequences into the running list while budget, blocks and max_num_seqs allow.

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
            if budget == 0:
                if not self.policy.admits_whole_batch:
                    break
                self._start(seq)  # static batching: joins now, computes in later steps
                continue
            start = self._share_in_flight(seq, self._cached_prefix(seq), scheduled)
            if start is None:
                held_back.append(self.waiting.popleft())
                continue
            cached = start
            num_new = seq.num_tokens - seq.num_computed_tokens - cached.num_tokens
            if num_new > budget and not self.enable_chunked_prefill and scheduled:
                break
            if self.enable_chunked_prefill:
                num_new = min(num_new, budget)
            before = seq.num_computed_tokens + cached.num_tokens
            if self._time is not None and (num_new := self._time.chunk(before, num_new)) == 0:
                break  # the step's time target is spent
            if self.kv.allocate_slots(seq, num_new, cached) is None:
                break  # out of blocks: admissions never preempt
            if self._time is not None:
                self._time.spend(before, num_new)
            self._start(seq)
            scheduled.append(self._entry(seq, num_new))
            budget = max(0, budget - num_new)
        self.waiting.extendleft(reversed(held_back))
        return budget

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
        return ScheduledSeq(seq, seq.num_computed_tokens, num_new, tuple(seq.block_ids))

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
        for seq, before, num_new, _blocks in plan.scheduled:
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
