"""Grouped expert compute: every (token, expert) assignment sorted by expert, each expert's tokens
gathered into one block and run through that expert's matmuls in one call each.

Where it sits: a sparse block (``engine/model/moe.py``) routes its rows (``layers/moe/router.py``)
and calls :func:`grouped_moe` with its :class:`Experts`: :class:`StackedExperts` (float weights
stacked (E, 2I, H) and (E, H, I), what the model holds) or :class:`KernelExperts` (each expert's two
matmuls resolved by a linear method of ``layers/linear``: int8, GGUF blocks, packed floats). The
Python loop runs over the experts that received a token, never over tokens. CUDA rows over float
experts go to the Triton fused-MoE kernel (``kernels/triton/fused_moe.py``) instead. Under tensor
parallelism each expert holds its share of the intermediate columns and the caller sums the ranks'
outputs (one all-reduce per block, as the dense MLP's down_proj).

Activations (:class:`Activation`, registered by name): ``silu`` (SwiGLU over gate columns then up
columns: Qwen3-MoE, Mixtral) and ``clamped_swiglu`` (gpt-oss: gate and up columns interleaved as
its checkpoint stores them, each clamped to ``limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``).
Float experts may carry biases (gpt-oss's), added after each matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from kvfleet.engine.kernels.fused_ops import silu_mul
from kvfleet.engine.kernels.linear import Linear
from kvfleet.engine.layers.linear.base import LinearMethod
from kvfleet.engine.layers.moe.router import Routing


class Activation(NamedTuple):
    """The expert activation ``name`` (registered in ``ACTIVATIONS``): (n, 2I) gate/up → (n, I).
    ``alpha`` and ``limit``: ``clamped_swiglu``'s (gpt-oss's ``swiglu_alpha``, ``swiglu_limit``)."""

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        try:
            fn = ACTIVATIONS[self.name]
        except KeyError:
            raise ValueError(
                f"no expert activation {self.name!r}; registered: {sorted(ACTIVATIONS)}"
            ) from None
        return fn(gate_up, self)


def _silu(gate_up: torch.Tensor, act: Activation) -> torch.Tensor:
    return silu_mul(gate_up)


def clamped_swiglu(gate_up: torch.Tensor, act: Activation) -> torch.Tensor:
    """gpt-oss's: columns alternate gate, up; gate clamped above at ``limit``, up to ±``limit``."""
    gate = gate_up[..., 0::2].clamp(max=act.limit)
    up = gate_up[..., 1::2].clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


ACTIVATIONS: dict[str, Callable[[torch.Tensor, Activation], torch.Tensor]] = {
    "silu": _silu,
    "clamped_swiglu": clamped_swiglu,
}
SILU = Activation()


class Experts(Protocol):
    """Each expert's two matmuls: ``gate_up`` (n, H) → (n, 2I), in the activation's column order
    (gate then up for ``silu``); ``down`` (n, I) → (n, H)."""

    @property
    def num_experts(self) -> int: ...
    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor: ...
    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor: ...


class StackedExperts(NamedTuple):
    """Float experts stacked: ``w13`` (E, 2I, H), rows in the activation's order (gate then up for
    ``silu``); ``w2`` (E, H, I); optional biases ``b13`` (E, 2I) and ``b2`` (E, H)."""

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w13[expert], None if self.b13 is None else self.b13[expert])

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.w2[expert], None if self.b2 is None else self.b2[expert])


class KernelExperts(NamedTuple):
    """Experts whose matmuls a linear method resolved, one (gate/up, down) pair per expert."""

    gate_ups: tuple[Linear, ...]
    downs: tuple[Linear, ...]

    @classmethod
    def load(
        cls, method: LinearMethod, gates: Sequence[Any], ups: Sequence[Any], downs: Sequence[Any]
    ) -> KernelExperts:
        """Per expert, its gate and up weights stacked into one matmul and its down weight into
        another, in ``method``'s format (as ``method.quantize`` or a checkpoint reader gives them)."""
        if not len(gates) == len(ups) == len(downs):
            raise ValueError(f"experts: {len(gates)} gate, {len(ups)} up and {len(downs)} down weights")
        return cls(
            tuple(method.load([g, u], None) for g, u in zip(gates, ups, strict=True)),
            tuple(method.load([d], None) for d in downs),
        )

    @property
    def num_experts(self) -> int:
        return len(self.downs)

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.gate_ups[expert](x)

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        return self.downs[expert](h)


class ExpertGroups(NamedTuple):
    """The assignments sorted by expert (stable: tokens ascending within an expert)."""

    token_of: torch.Tensor  # (T * top_k,) the token row of each sorted assignment
    weight_of: torch.Tensor  # (T * top_k,) its routing weight
    counts: list[int]  # per expert, how many assignments it received (zeros included)


def group_by_expert(routing: Routing, num_experts: int) -> ExpertGroups:
    flat = routing.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    top_k = routing.experts.shape[1]
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(order // top_k, routing.weights.reshape(-1)[order], counts)


def grouped_moe(
    x: torch.Tensor, routing: Routing, experts: Experts, activation: Activation = SILU
) -> torch.Tensor:
    """The experts' weighted sum for each row of ``x`` (T, H), in ``x``'s dtype."""
    # Invariant: rows start .. start+n of the gathered block are exactly expert e's n assignments,
    # so each expert runs once over all its tokens and an expert without tokens never runs.
    fused = isinstance(experts, StackedExperts) and experts.b13 is None and experts.b2 is None
    if x.is_cuda and fused and activation.name == "silu":  # triton imported only where a GPU runs
        from kvfleet.engine.kernels.triton.fused_moe import fused_moe

        assert isinstance(experts, StackedExperts)
        return fused_moe(x, routing.experts, routing.weights, experts.w13, experts.w2)
    out = torch.zeros_like(x)
    if x.shape[0] == 0:  # a step whose rows all stop before this layer
        return out
    groups = group_by_expert(routing, experts.num_experts)
    gathered = x[groups.token_of]
    out_rows: list[torch.Tensor] = []
    start = 0
    for expert, n in enumerate(groups.counts):
        if n:
            rows = gathered[start : start + n]
            out_rows.append(experts.down(expert, activation(experts.gate_up(expert, rows))))
            start += n
    ys = torch.cat(out_rows).to(x.dtype) * groups.weight_of.to(x.dtype)[:, None]
    return out.index_add_(0, groups.token_of, ys)
