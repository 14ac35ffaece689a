"""A launched step: its tokens picked on the device, read when the engine asks (async scheduling).

Where it sits: ``ModelRunner.launch(plan)`` runs the forward and the sampler's pick and returns a
:class:`PickedStep`; ``ModelRunner.execute`` reads it at once, ``engine/async_scheduling.py`` only
after the next step is launched. The next launch takes the tokens still on the device for its
placeholder inputs (``PLACEHOLDER_TOKEN``): through the static buffers on the decode path
(``StepBuffers``' ``feed_rows``), with :func:`feed_flat` on the eager path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sampler import Sampler, SampleRequest
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.sequence import PLACEHOLDER_TOKEN


@dataclass
class PickedStep:
    """One step's picked tokens (``tokens[i]`` for ``seq_ids[i]``), not read yet."""

    sampler: Sampler
    tokens: torch.Tensor
    logits: torch.Tensor
    requests: list[SampleRequest] | None
    seq_ids: tuple[int, ...]

    @cached_property
    def rows_of(self) -> dict[int, int]:
        """seq id → its row in ``tokens`` (read only when the next step feeds on them)."""
        return {seq_id: row for row, seq_id in enumerate(self.seq_ids)}

    def read(self) -> dict[int, SampleResult]:
        """The samples by seq id: the step's one synchronisation."""
        with torch.inference_mode():
            results = self.sampler.read(self.tokens, self.logits, self.requests)
        return dict(zip(self.seq_ids, results, strict=True))


def feed_flat(input_ids: torch.Tensor, plan: SchedulerPlan, fed: PickedStep | None) -> None:
    """Eager path: each placeholder input row of the flat batch takes ``fed``'s token for its sequence."""
    dst: list[int] = []
    src: list[int] = []
    row = 0
    for seq, start, num_new, _ in plan.scheduled:
        outputs = seq.output_token_ids
        if num_new == 1 and outputs and outputs[-1] == PLACEHOLDER_TOKEN and start == seq.num_tokens - 1:
            assert fed is not None, "a placeholder token without the step that samples it"
            dst.append(row)
            src.append(fed.rows_of[seq.seq_id])
        row += num_new
    if dst:
        device = input_ids.device
        rows = torch.tensor(dst, dtype=torch.int64, device=device)
        input_ids.index_copy_(0, rows, fed.tokens.index_select(0, torch.tensor(src, device=device)))  # type: ignore[union-attr]
