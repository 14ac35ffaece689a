"""One sequence's state as it moves through the engine: the first box of the pipeline.

``Sequence`` → ``BlockPool``/``KVCacheManager`` → ``Scheduler.schedule() -> SchedulerPlan``
→ ``ModelRunner.execute(plan)`` → ``Engine.step()``.

A sequence owns its token ids and the ids of the KV blocks that hold them; it never
holds tensors. ``num_computed_tokens`` counts the tokens whose KV is in the cache; the
scheduler lets it catch up with ``num_tokens`` a chunk at a time, which is all that
prefill and decode are (docs/engine/scheduler-and-kv.md).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from kvfleet.engine.sampling_params import SamplingParams

_seq_ids = itertools.count()

# Async scheduling (engine/core/async_scheduling.py): the token a launched step samples, appended before
# it is read so the next step can be planned; never a vocabulary id, never emitted.
PLACEHOLDER_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; waits again and recomputes
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"  # the client went away or the request was cancelled

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}


# eq=False: sequences compare (and hash) by identity; the queues remove them by identity.
# slots: the scheduler reads these fields for every running sequence on every step.
@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # which of the request's n samples
    arrival_time: float = 0.0
    priority: int = 0  # lower value = more important (vLLM's convention)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last allocation
    block_ids: list[int] = field(default_factory=list)
    # With several KV cache groups (kv/groups.py): the block tables of groups 1.. (block_ids is group 0's)
    group_block_ids: list[list[int]] = field(default_factory=list)
    num_preemptions: int = 0
    # Seeds the prefix-cache hash chain (kv.block_hash.cache_namespace): b"" is shared by all.
    cache_namespace: bytes = b""
    lora_name: str | None = None  # the LoRA adapter it runs under (engine/lora); None: the base model
    # The prefix-cache hash chain of its full blocks so far, filled lazily by the KV cache manager
    # (a full block's hash never changes: tokens are only appended).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def tokens(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole sequence."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt) : end - len(prompt)]
        return prompt[start:] + self.output_token_ids[: end - len(prompt)]
