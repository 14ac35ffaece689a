"""The plain torch reference of a mixture-of-experts feed-forward: one token at a time, one expert at a time.

Where it sits: tests only compare the grouped compute (``layers/moe/grouped.py``), the Triton fused
kernel (``kernels/triton/fused_moe.py``) and the quantized expert formats against it; nothing
serves through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfleet.engine.layers.moe.router import Routing


def _glu(h: torch.Tensor, clamped: tuple[float, float] | None) -> torch.Tensor:
    if clamped is None:  # SwiGLU: gate rows then up rows
        gate, up = h.chunk(2)
        return F.silu(gate) * up
    alpha, limit = clamped  # gpt-oss: gate and up rows alternate, both clamped
    gate, up = h[0::2].clamp(max=limit), h[1::2].clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def moe_reference(
    x: torch.Tensor,
    routing: Routing,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    clamped: tuple[float, float] | None = None,
) -> torch.Tensor:
    """``sum_j weight[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for each token ``t``, ``e`` its
    j-th expert. ``w13``: (E, 2I, H), gate rows then up rows; ``w2``: (E, H, I); biases ``b13`` (E, 2I)
    and ``b2`` (E, H) where given. ``clamped``: (alpha, limit) of gpt-oss's clamped SwiGLU, whose
    gate and up rows alternate in ``w13``."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(routing.experts.shape[1]):
            e = int(routing.experts[t, j])
            h = w13[e].float() @ x[t].float() + (0.0 if b13 is None else b13[e].float())
            y = w2[e].float() @ _glu(h, clamped) + (0.0 if b2 is None else b2[e].float())
            out[t] += float(routing.weights[t, j]) * y
    return out.to(x.dtype)
