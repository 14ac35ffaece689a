"""Routing that leaves experts idle, for the mixture-of-experts tests of tests/engine/layers."""

from __future__ import annotations

import torch

from kvfleet.engine.layers.moe import Routing, get_router


def skewed_logits_routing(
    router: str, tokens: int, *, experts: int, top_k: int, renormalize: bool, seed: int = 1
) -> Routing:
    """``router``'s routing of logits that never pick experts 5 and up: those receive no token at any
    batch size."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 5:] -= 100.0
    return get_router(router)(logits, top_k, renormalize)
