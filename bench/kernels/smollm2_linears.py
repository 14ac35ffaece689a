"""SmolLM2-135M's linears as the kernel micro-benchmarks drive them: one layer's four matmul shapes
and a pass of a linear over every weight of every layer.

Where it sits: shared by ``prepacked_linear_micro``, ``skinny_linear_micro`` and ``packers_micro``
(``quant_paths_micro`` writes the same shapes as (out, in)), so that they time the same layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# (in, out) of one layer's linears: packed q/k/v, o_proj, packed gate/up, down_proj
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def linear_pass(
    layers: Sequence[Sequence[torch.Tensor]],
    xs: dict[int, torch.Tensor],
    linear: Callable[..., object],
    *extra: object,
) -> None:
    """``linear(x, w, *extra)`` for every weight ``w`` of every layer, ``x`` the input as wide as ``w``."""
    for layer in layers:
        for w in layer:
            linear(xs[w.shape[1]], w, *extra)
