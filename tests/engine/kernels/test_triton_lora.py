"""The Triton LoRA kernel against the torch path of ``LoraContext`` (interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.kernels.triton.lora import add_lora
from kvfleet.engine.lora.context import LoraContext, lora_delta


def _stack(slots: int, rank: int, fan_in: int, fan_out: int, ranks: list[int], gen: torch.Generator):  # type: ignore[no-untyped-def]
    """Stacked (slots, R, in) / (slots, R, out) with slot 0 zero and slot s holding rank ranks[s-1] < R."""
    a = torch.zeros(slots, rank, fan_in)
    b = torch.zeros(slots, rank, fan_out)
    for s, r in enumerate(ranks, start=1):
        a[s, :r] = torch.randn(r, fan_in, generator=gen)
        b[s, :r] = torch.randn(r, fan_out, generator=gen)
    return a, b


@pytest.mark.parametrize(
    ("token_slots", "rank", "fan_in", "fan_out"),
    [
        ([0, 1, 1, 2, 0, 3, 3, 3, 2], 8, 96, 80),  # base rows among three adapters, out not a tile multiple
        ([2] * 5, 16, 64, 128),  # one adapter for the whole step (the torch path's unmasked case)
        ([1, 0, 2], 4, 130, 33),  # rank below the kernel's padding, odd sizes
    ],
)
def test_the_kernel_adds_each_tokens_own_adapter_delta_like_the_torch_path(
    device: torch.device, token_slots: list[int], rank: int, fan_in: int, fan_out: int
) -> None:
    gen = torch.Generator().manual_seed(len(token_slots))
    a, b = _stack(4, rank, fan_in, fan_out, [rank, rank // 2, 1], gen)
    x = torch.randn(len(token_slots), fan_in, generator=gen)
    wide = torch.randn(len(token_slots), fan_out + 7, generator=gen)  # the slice sits inside a wider output
    ctx = LoraContext.build(
        token_slots, {"q_proj": a[None]}, {"q_proj": b[None]}, {"q_proj": fan_out}, x.device
    )
    want = wide.clone()
    want[:, 3 : 3 + fan_out] += lora_delta(x, a, b, ctx)
    got = wide.to(device)
    add_lora(x.to(device), a.to(device), b.to(device), ctx.token_slots.to(device), got[:, 3 : 3 + fan_out])
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    base_rows = [i for i, s in enumerate(token_slots) if s == 0]
    assert torch.equal(got.cpu()[base_rows], wide[base_rows]), "base-model rows are left exactly as they were"


def test_the_torch_path_equals_a_per_token_loop(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(7)
    a, b = _stack(3, 4, 16, 12, [4, 2], gen)
    slots = [1, 0, 2, 2, 1]
    x = torch.randn(5, 16, generator=gen)
    ctx = LoraContext.build(slots, {"o_proj": a[None]}, {"o_proj": b[None]}, {"o_proj": 12}, x.device)
    want = torch.stack([(x[t] @ a[s].t()) @ b[s] for t, s in enumerate(slots)])
    torch.testing.assert_close(lora_delta(x, a, b, ctx), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_in_bf16_on_a_gpu_at_llama_shapes() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = _stack(5, 16, 4096, 1024, [16, 8, 16, 4], gen)
    slots = [i % 5 for i in range(300)]
    # the kernel's inputs are bf16: the reference takes the same rounded values, in float32
    x, a, b = (t.bfloat16().float() for t in (torch.randn(300, 4096, generator=gen), a, b))
    ctx = LoraContext.build(slots, {"k_proj": a[None]}, {"k_proj": b[None]}, {"k_proj": 1024}, x.device)
    want = lora_delta(x, a, b, ctx)
    out = torch.zeros(300, 1024, device="cuda", dtype=torch.bfloat16)
    add_lora(x.cuda().bfloat16(), a.cuda().bfloat16(), b.cuda().bfloat16(), ctx.token_slots.cuda(), out)
    # float32 accumulation, one bf16 rounding of the output (half an ulp: 2**-9 relative)
    torch.testing.assert_close(out.float().cpu(), want, atol=0.05, rtol=2**-8)
