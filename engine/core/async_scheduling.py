"""Async scheduling (vLLM's ``--async-scheduling``): step N+1 is planned and launched before step N's
tokens are read, so the host's work for N+1 overlaps the device's for N.

Where it sits: ``Engine.step()`` hands each call to :class:`AsyncSteps` when
``EngineConfig.async_scheduling`` is set and the runner can launch a step without reading it
(``ModelRunner.launch``; the simulator has none). Torch-free, like the engine.

One call, with step N launched (``pending``) by the previous one:

1. ``Scheduler.schedule()`` plans step N+1: each sequence that sampled in step N already holds
   ``PLACEHOLDER_TOKEN`` as its last token, so it gets a one-token decode row (and its KV slot);
2. the runner launches it, taking the placeholders' tokens from step N's on the device;
3. step N's tokens are read (the synchronisation: on a GPU the device is busy with N+1 meanwhile),
   put in place of the placeholders and processed (stop checks, detokenisation, deltas);
4. ``Scheduler.update()`` advances step N+1's sequences, with placeholders for its tokens.

It returns step N's deltas. A sequence that finished in step N still has a row in step N+1: its
token is dropped (``update`` skips finished sequences, so it is never emitted) and its blocks, freed
when it finished, are written by that row before any later step's write (one device stream).

Not overlapped: steps whose sampling needs the previous token on the host (penalties read the output
ids, logprobs the logits a CUDA graph's next replay overwrites, a structured output its grammar's
matcher). While such a request is unfinished, a call with a pending step only reads it, and the
calls after run one synchronous step each (``Engine.sync_step``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvfleet.engine.outputs import ReqDelta, SampleResult
from kvfleet.engine.sched.scheduler import Sampled
from kvfleet.engine.sequence import PLACEHOLDER_TOKEN

if (
    TYPE_CHECKING
):  # the engine imports this module, the real runner imports torch: named for the type checker only
    from kvfleet.engine.core.engine import Engine
    from kvfleet.engine.runner.launched_step import PickedStep
    from kvfleet.engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

_PLACEHOLDER = SampleResult(PLACEHOLDER_TOKEN)


class _Placeholders(dict[int, SampleResult]):
    """What ``Scheduler.update`` appends for a launched step: a placeholder for every sequence."""

    def get(self, key: int, default: object = None) -> SampleResult:  # type: ignore[override]
        return _PLACEHOLDER


class AsyncSteps:
    """The engine's steps, each launched before the previous one's tokens are read."""

    def __init__(self, engine: Engine, runner: ModelRunner) -> None:
        self.engine, self.runner = engine, runner
        self.pending: tuple[PickedStep, list[Sampled]] | None = None

    @classmethod
    def for_engine(cls, engine: Engine) -> AsyncSteps | None:
        """None (one step at a time) when the runner cannot launch a step without reading it."""
        runner = engine.runner
        if not hasattr(runner, "launch") or getattr(runner, "leader", None) is not None:
            log.warning("async scheduling: off (this runner reads every step's tokens before the next)")
            return None
        return cls(engine, runner)  # type: ignore[arg-type]

    # Invariant: between calls, exactly the sequences in pending's list end with PLACEHOLDER_TOKEN
    # (one each), and the runner's last launched step holds their tokens.
    def step(self) -> list[ReqDelta]:
        engine = self.engine
        if engine.reads_host_tokens:
            return self._read_pending() if self.pending is not None else engine.sync_step()
        started = time.perf_counter()
        plan = engine.scheduler.schedule()
        if plan.is_empty:
            if self.pending is not None:
                return self._read_pending()
            engine.idle()
            return []
        launched = self.runner.launch(plan)
        outputs = self._read_pending() if self.pending is not None else []
        sampled = engine.scheduler.update(plan, _Placeholders())
        self.pending = (launched, sampled) if sampled else None
        engine.observe(plan, started)
        return outputs

    def _read_pending(self) -> list[ReqDelta]:
        """Read the pending step's tokens, put them in place of its placeholders, and process them."""
        assert self.pending is not None
        launched, sampled = self.pending
        self.pending = None
        results = launched.read()
        real: list[Sampled] = []
        for seq, _ in sampled:
            outputs = seq.output_token_ids
            if not outputs or outputs[-1] != PLACEHOLDER_TOKEN:
                continue  # aborted meanwhile: Engine.abort dropped its placeholder (nothing else does)
            result = results[seq.seq_id]
            outputs[-1] = result.token_id
            real.append(Sampled(seq, result))
        return self.engine.process(real)
