"""What the engine loop asks of a runner: the one base class the real and the simulated runner share.

Where it sits: ``Engine.step()`` (``engine/core/engine.py``) calls :meth:`Runner.execute` with the
scheduler's plan; :class:`~kvfleet.engine.runner.model_runner.ModelRunner` (torch) and
:class:`~kvfleet.engine.sim.SimRunner` (a timing model) implement it. Torch-free: the engine core imports
this module, never the real runner's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sampling_params import RequestError
from kvfleet.engine.sched.plan import SchedulerPlan


class Runner(ABC):
    """Runs one step of a plan and samples; owns the KV cache memory."""

    @property
    @abstractmethod
    def num_kv_blocks(self) -> int:
        """How many KV blocks the cache holds (fixed once the runner is built)."""

    @abstractmethod
    def execute(self, plan: SchedulerPlan) -> dict[int, SampleResult]:
        """Compute the plan's tokens; return a sample for each ``seq_id`` whose entry samples."""

    def pool(self, prompts: list[list[int]], dimensions: int | None) -> list[bytes]:
        """Each prompt's embedding as float32 bytes (``--runner pooling``); a generating runner refuses."""
        raise RequestError(
            "model",
            "this engine generates text: it serves embeddings only when started with --runner pooling",
        )
