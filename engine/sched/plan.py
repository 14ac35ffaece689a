"""The scheduler's output: which tokens of which sequences one engine step computes.

Where it sits: ``Scheduler.schedule()`` returns a :class:`SchedulerPlan`; the runner
flattens it into one batch; ``Scheduler.update()`` takes the sampled tokens back. The
plan holds ids and counts only, never tensors.

For each scheduled sequence the step computes the KV of
``seq.all_token_ids[start : start + num_new_tokens]`` with ``start =
seq.num_computed_tokens`` (as it was when the plan was made, kept in
``num_computed_before``). When that chunk reaches the end of the known tokens the step
also samples one new token (``sample`` is True); a chunk in the middle of a long prompt
samples nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvfleet.engine.sequence import Sequence


# A NamedTuple rather than a frozen dataclass: the scheduler builds one per running sequence
# per step, and a tuple is built several times faster.
class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_computed_before: int  # == seq.num_computed_tokens when the plan was made
    num_new_tokens: int  # tokens whose KV this step computes (>= 1)
    block_ids: tuple[int, ...]  # the sequence's whole block table for this step (KV cache group 0's)
    group_block_ids: tuple[tuple[int, ...], ...] = ()  # groups 1..'s tables (engine/kv/groups.py)

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache after this step (the attention's key length)."""
        return self.num_computed_before + self.num_new_tokens

    @property
    def sample(self) -> bool:
        return self.context_len == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.tokens(self.num_computed_before, self.context_len)


@dataclass(frozen=True)
class SchedulerPlan:
    scheduled: tuple[ScheduledSeq, ...] = ()
    preempted: tuple[Sequence, ...] = ()  # sequences that lost their blocks this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
