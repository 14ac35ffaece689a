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


class LaunchedStep(Protocol):
    """A step whose tokens are picked on the device but not yet read (async scheduling)."""

    def read(self) -> dict[int, SampleResult]:
        """The step's samples by ``seq_id`` (the synchronisation)."""
        ...


class LaunchingRunner(Runner, Protocol):
    """A runner that can launch a step and hand its tokens to the next one on the device."""

    def launch(self, plan: SchedulerPlan) -> LaunchedStep:
        """Run the plan without reading its tokens; an input token that is ``PLACEHOLDER_TOKEN`` is
        the one the previous launched step sampled for that sequence, taken on the device."""
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
