"""The small interfaces the engine loop is built from, so the pieces can be swapped.

``Engine.step()`` calls a :class:`Runner` (the real ``ModelRunner`` or the simulator's
timing model) with the scheduler's plan, and a :class:`Tokenizer` to turn text into
ids and back. Neither interface exposes tensors to the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sched.plan import SchedulerPlan


class Runner(Protocol):
    """Runs one step of a plan and samples; owns the KV cache memory."""

    @property
    def num_kv_blocks(self) -> int:
        """How many KV blocks the cache holds (fixed once the runner is built)."""
        ...

    def execute(self, plan: SchedulerPlan) -> dict[int, SampleResult]:
        """Compute the plan's tokens; return a sample for each ``seq_id`` whose entry samples."""
        ...


class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (for incremental, UTF-8-safe detokenisation)."""
        ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...
