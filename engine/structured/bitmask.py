"""Apply the grammars' token bitmasks to the logits: the step-path cost of structured outputs.

Where it sits: :meth:`StructuredOutputs.mask` fills one bitmask row per constrained logits row
(bit t of a row set: token t allowed), then calls :func:`apply_bitmask` before the sampler.
On a GPU xgrammar's kernel applies it. On the CPU, xgrammar's loop branches on every bit,
and a mask that mixes allowed and refused tokens (inside a JSON string: every token with a
quote or a backslash refused) mispredicts often; here the bits are unpacked with numpy and
applied with branch-free tensor arithmetic instead (``min(logit, +inf or -inf)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], vocab_size: int) -> None:
    """Set ``logits[rows[i], t]`` to -inf wherever bit t of ``bitmask[rows[i]]`` is clear, in place."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        mask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab_size, indices=list(rows))
        return
    every_row = len(rows) == logits.shape[0]
    masks = bitmask[: logits.shape[0]] if every_row else bitmask[list(rows)]
    width = min(vocab_size, logits.shape[1])
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :width]
    # Invariant: bound is +inf for an allowed token and -inf for a refused one, so min(logit, bound)
    # keeps the one and refuses the other; ids at or past vocab_size are left alone, as xgrammar does.
    bound = torch.from_numpy(bits).to(torch.float32).mul_(2.0).sub_(1.0).mul_(float("inf"))
    if every_row:
        logits[:, :width].clamp_(max=bound)
        return
    index = torch.tensor(list(rows), dtype=torch.long)
    logits[index, :width] = torch.minimum(logits[index, :width], bound)
