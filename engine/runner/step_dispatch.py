"""The step dispatcher: which way one scheduler plan runs, decided once per step, with the reason.

Where it sits: ``ModelRunner.launch`` (``engine/runner/model_runner.py``) asks :meth:`StepDispatcher.pick` for
each plan ``Scheduler.schedule()`` made, logs the route at debug level, and runs it:

* ``graph``: a decode step (every sequence one new token and sampling, no LoRA adapter) padded up
  to a captured size of the static step buffers, replayed as a CUDA graph (``engine/runner/cuda_graphs.py``);
* ``native``: every decoder layer in one native call (``engine/model/fused_layers.py``,
  ``csrc/decode_layers.c``), on the CPU, for float32 weights the call reads;
* ``per_op``: the model's layer loop, op by op: any step, on any device.

The decision is a pure function, :func:`route`, of the plan's :class:`PlanShape` (counts only,
no tensor) and the runner's :class:`RunnerCaps` (what it captured and which native step its
weights offer, fixed unless the weights are repacked or the native step turned off), so it is
tested on plans alone (``tests/engine/test_step_dispatch.py``). Sampling parameters and
structured outputs do not enter it: the sampler and the grammar mask read the logits of
whichever path made them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from kvfleet.engine.runner.cuda_graphs import padded_size
from kvfleet.engine.sched.plan import SchedulerPlan

if TYPE_CHECKING:  # the model side imports torch; the dispatcher only names what it offers
    from kvfleet.engine.model.fused_layers import NativeStep

log = logging.getLogger(__name__)

RoutePath = Literal["graph", "native", "per_op"]


class StepRoute(NamedTuple):
    """The path one step takes, the rows its forward runs (a decode step padded up to a size of the
    static buffers, else the plan's tokens), whether those are padded decode rows, and why."""

    path: RoutePath
    reason: str
    rows: int = 0
    padded: bool = False


@dataclass(frozen=True)
class PlanShape:
    """What the route depends on in a plan: counts and flags, read from the plan alone."""

    seqs: int  # scheduled sequences
    tokens: int  # rows of the step's flat batch
    decode: bool  # every sequence one new token, and sampling
    prompt_chunks: bool  # some sequence adds more than one token (the attention's prefill kernel)
    lora: bool  # some sequence runs under a LoRA adapter
    widest: int  # the most KV blocks one sequence's table holds

    @classmethod
    def of(cls, plan: SchedulerPlan) -> PlanShape:
        s = plan.scheduled
        return cls(
            seqs=len(s),
            tokens=sum(e.num_new_tokens for e in s),
            decode=all(e.num_new_tokens == 1 and e.sample for e in s),
            prompt_chunks=any(e.num_new_tokens > 1 for e in s),
            lora=any(e.seq.lora_name is not None for e in s),
            widest=max((len(e.block_ids) for e in s), default=0),
        )


@dataclass(frozen=True)
class RunnerCaps:
    """What the runner can run a step with, besides the per-op path (which runs any step).

    ``sizes``: the decode batch sizes the static step buffers are padded to (empty: none; tensor
    parallelism and dynamic rope have none), of at most ``max_blocks`` KV blocks a row; ``graphs``:
    those sizes are captured CUDA graphs (else plain calls over the same buffers); ``native``: the
    one-call step, or None with ``no_native`` saying why not."""

    sizes: tuple[int, ...] = ()
    max_blocks: int = 0
    graphs: bool = False
    native: NativeStep | None = None
    no_native: str = "no native step"


def padded_rows(shape: PlanShape, caps: RunnerCaps) -> int | None:
    """The size a decode step is padded to in the static buffers; None: it runs unpadded."""
    if not shape.decode or shape.lora or shape.widest > caps.max_blocks:
        return None
    return padded_size(caps.sizes, shape.seqs)


def _refusal(shape: PlanShape, rows: int, native: NativeStep | None, no_native: str) -> str | None:
    """Why the native step cannot take this step (None: it can), checked as the native call checks."""
    if native is None:
        return no_native
    if shape.lora:
        return "a LoRA adapter applies per row, which the native call does not hold"
    if native.max_rows is not None and rows > native.max_rows:
        return f"{rows} rows, past the {native.max_rows} the native call runs the per-op kernels for"
    if shape.prompt_chunks and not native.prompt_chunks:
        return "prompt chunks of this geometry run on SDPA, not the native prefill kernel"
    return None


def _kind(shape: PlanShape) -> str:
    if shape.decode:
        return f"decode step of {shape.seqs} rows"
    chunks = "with prompt chunks" if shape.prompt_chunks else "of single tokens"
    return f"step of {shape.seqs} sequences, {shape.tokens} rows, {chunks}"


# Invariant: exactly one route per plan, and one the runner can run: "graph" only for a padded decode
# step at a captured size, "native" only where every plan-level check of the native call holds for
# the rows its forward will run; everything else is "per_op", which runs any step.
def route(shape: PlanShape, caps: RunnerCaps) -> StepRoute:
    """The route of a step of ``shape`` on a runner of ``caps``."""
    padded = padded_rows(shape, caps)
    rows = shape.tokens if padded is None else padded
    kind = _kind(shape)
    if padded is not None and caps.graphs:
        return StepRoute("graph", f"{kind}: replays the graph captured for {padded} rows", rows, True)
    refusal = _refusal(shape, rows, caps.native, caps.no_native)
    if refusal is None:
        pad = "" if padded is None or padded == shape.seqs else f" (padded to {padded})"
        return StepRoute("native", f"{kind}{pad}: every layer in one native call", rows, padded is not None)
    if caps.graphs:
        refusal = f"no captured graph holds it, and {refusal}"
    return StepRoute("per_op", f"{kind}: {refusal}", rows, padded is not None)


class StepDispatcher:
    """Picks each step's route over the runner's capabilities, and says it in a debug log."""

    def __init__(self, caps: RunnerCaps) -> None:
        self.caps = caps

    def pick(self, plan: SchedulerPlan) -> StepRoute:
        chosen = route(PlanShape.of(plan), self.caps)
        log.debug("step route %s: %s", chosen.path, chosen.reason)
        return chosen
