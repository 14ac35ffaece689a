"""A launched step: its tokens picked on the device, read when the engine asks (async scheduling).

Where it sits: ``ModelRunner.launch(plan)`` runs the forward and the sampler's pick and returns a
:class:`PickedStep`; ``ModelRunner.execute`` reads it at once, ``engine/core/async_scheduling.py`` only
after the next step is launched. The next launch takes the tokens still on the device for its
placeholder inputs (``PLACEHOLDER_TOKEN``) through the step buffers' ``feed_rows``
(``engine/runner/step_buffers.py``), on every route.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.runner.sampler import Sampler, SampleRequest


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
