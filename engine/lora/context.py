"""One step's LoRA: each token's adapter slot, and the delta each targeted projection adds to its output.

Where it sits: the runner asks :meth:`LoraManager.context` for a :class:`LoraContext` when a
step holds at least one adapter's tokens (None otherwise: the base-only path pays nothing),
and puts it on the step's ``AttentionMetadata.lora``. The model calls :meth:`LoraContext.add`
right after a base matmul: ``out[:, slice of module m] += scale · (x Aᵐ_{slot(t)}ᵀ) Bᵐ_{slot(t)}``
per token ``t``, for each module ``m`` of a fused projection (q/k/v, gate/up) in order.

Two ways to compute it, equal up to float rounding (a test holds them to it):
- ``torch`` (CPU, and the reference): the stacked slots 1..S of one layer side by side, as one
  shrink ``x @ [A_1; ...; A_S]ᵀ`` (T, S·R), masked to each token's own slot's R columns, and one
  expand ``@ [B_1; ...; B_S]`` (punica's sgmv as two dense matmuls: no per-adapter loop, no
  gather of per-token matrices); a step whose tokens all share one adapter skips the mask.
- ``triton`` (CUDA): :func:`kvfleet.engine.kernels.triton.lora.add_lora`, bgmv-style, one program per
  (token, output tile) gathering its slot's A and B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Kernel = Literal["torch", "triton"]

# The module order of each fused projection's output columns.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
O_PROJ = ("o_proj",)
DOWN_PROJ = ("down_proj",)


@dataclass(frozen=True)
class LoraContext:
    token_slots: torch.Tensor  # (T,) int32: 0 = base model, else the adapter's device slot
    num_slots: int  # S: the highest slot any token uses
    single_slot: int | None  # every token uses this one slot (> 0): no mask needed
    mask: torch.Tensor | None  # (T, S·R), 1 where column j belongs to token t's slot (torch kernel)
    a: dict[str, torch.Tensor]  # module → (layers, max_loras + 1, R, in)
    b: dict[str, torch.Tensor]  # module → (layers, max_loras + 1, R, out)
    widths: dict[str, int]  # module → its output columns
    kernel: Kernel

    @classmethod
    def build(
        cls,
        token_slots: list[int],
        a: dict[str, torch.Tensor],
        b: dict[str, torch.Tensor],
        widths: dict[str, int],
        device: torch.device,
        kernel: Kernel = "torch",
    ) -> LoraContext:
        first = next(iter(a.values()))
        rank, dtype = first.shape[2], first.dtype
        slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
        num_slots = max(token_slots)
        single = (
            token_slots[0] if token_slots[0] > 0 and all(s == token_slots[0] for s in token_slots) else None
        )
        mask = None
        if kernel == "torch" and single is None:
            columns = torch.arange(1, num_slots + 1, device=device, dtype=torch.int32).repeat_interleave(rank)
            mask = (slots[:, None] == columns[None, :]).to(dtype)
        return cls(slots, num_slots, single, mask, a, b, widths, kernel)

    def add(self, x: torch.Tensor, out: torch.Tensor, layer: int, modules: tuple[str, ...]) -> None:
        """Add each module's delta to its column slice of ``out`` (the modules side by side, in order)."""
        col = 0
        for module in modules:
            a = self.a.get(module)
            if a is None:  # no resident adapter targets it: its columns are left alone
                col += self.widths[module]
                continue
            b = self.b[module]
            width = b.shape[3]
            target = out[:, col : col + width]
            if self.kernel == "triton":
                from kvfleet.engine.kernels.triton.lora import add_lora

                add_lora(x, a[layer], b[layer], self.token_slots, target)
            else:
                target += lora_delta(x, a[layer], b[layer], self)
            col += width


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ctx: LoraContext) -> torch.Tensor:
    """The torch reference: (T, out) delta of one layer's stacked A (S+1, R, in) and B (S+1, R, out)."""
    if ctx.single_slot is not None:
        s = ctx.single_slot
        return (x @ a[s].t()) @ b[s]
    assert ctx.mask is not None
    n, rank = ctx.num_slots, a.shape[1]
    shrink = (x @ a[1 : n + 1].reshape(n * rank, -1).t()) * ctx.mask
    return shrink @ b[1 : n + 1].reshape(n * rank, -1)
