"""The plain torch reference of a mixture-of-experts feed-forward: one token at a time, one expert at a time.

Where it sits: tests only compare the grouped compute (``layers/moe/grouped.py``), the Triton fused
kernel (``kernels/triton/fused_moe.py``) and the quantized expert formats against it; nothing
serves through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfleet.engine.layers.moe.router import Routing


def moe_reference(x: torch.Tensor, routing: Routing, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``sum_j weight[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for each token ``t``, ``e`` its
    j-th expert. ``w13``: (E, 2I, H), gate rows then up rows; ``w2``: (E, H, I)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(routing.experts.shape[1]):
            e = int(routing.experts[t, j])
            gate, up = (w13[e].float() @ x[t].float()).chunk(2)
            out[t] += float(routing.weights[t, j]) * (w2[e].float() @ (F.silu(gate) * up))
    return out.to(x.dtype)
