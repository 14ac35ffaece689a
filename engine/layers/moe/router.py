"""The mixture-of-experts router: which ``top_k`` experts each token goes to, and with what weight.

Where it sits: a sparse block (``engine/model/moe.py``) computes each token's router logits with its
``gate`` linear, asks the router registered under the config's name for a :class:`Routing`, and
hands it to the grouped expert compute (``layers/moe/grouped.py``). Routers register by name
(:func:`register_router`); ``softmax_topk`` is transformers' Qwen3-MoE and Mixtral router,
``topk_softmax`` gpt-oss's (the top-k logits first, then a softmax over those k alone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """Per token (rows), the ``top_k`` experts it goes to and the weight of each one's output."""

    experts: torch.Tensor  # (T, top_k) int64 expert ids
    weights: torch.Tensor  # (T, top_k) float32


Router = Callable[[torch.Tensor, int, bool], Routing]
_ROUTERS: dict[str, Router] = {}


def register_router(name: str) -> Callable[[Router], Router]:
    def add(fn: Router) -> Router:
        if name in _ROUTERS:
            raise ValueError(f"router {name!r} is registered twice")
        _ROUTERS[name] = fn
        return fn

    return add


def get_router(name: str) -> Router:
    try:
        return _ROUTERS[name]
    except KeyError:
        raise ValueError(f"no router {name!r}; registered: {sorted(_ROUTERS)}") from None


@register_router("softmax_topk")
def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over all experts in float32, the ``top_k`` largest kept; ``renormalize``: those
    weights divided by their sum (Mixtral always; Qwen3-MoE where ``norm_topk_prob``)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


@register_router("topk_softmax")
def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """gpt-oss's: the ``top_k`` largest logits, then a softmax over those alone (so the weights
    always sum to 1; ``renormalize`` changes nothing). In the logits' dtype, as transformers."""
    top, experts = torch.topk(logits, top_k, dim=-1)
    return Routing(experts, torch.softmax(top, dim=-1).float())
