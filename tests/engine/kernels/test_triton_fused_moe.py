"""The Triton fused-MoE kernel against the plain per-token torch reference at 1, 7 and 64 tokens,
with experts that receive no token: under Triton's interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.kernels.triton.fused_moe import BLOCK_M, align_by_expert, fused_moe
from kvfleet.engine.layers.moe import get_router
from kvfleet.engine.layers.moe.reference import moe_reference

E, TOP_K, H, INTER = 8, 2, 64, 48  # 2I = 96: three 32-column blocks; I = 48: a partial K block
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_alignment_pads_each_experts_run_to_whole_blocks_and_skips_idle_experts() -> None:
    experts = torch.tensor([[3, 0], [0, 3], [1, 3]])
    aligned = align_by_expert(experts, 5)
    assert aligned.block_expert.tolist() == [0, 1, 3]
    ids = aligned.sorted_ids.view(3, BLOCK_M)
    assert ids[0, :2].tolist() == [1, 2] and ids[1, :1].tolist() == [4] and ids[2, :3].tolist() == [0, 3, 5]
    assert (ids[0, 2:] == 6).all() and (ids[1, 1:] == 6).all() and (ids[2, 3:] == 6).all()


@pytest.mark.parametrize("tokens", (1, 7, 64))
def test_fused_moe_equals_the_per_token_reference(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=g) * 0.1, torch.randn(E, H, INTER, generator=g) * 0.1
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    logits[:, 6:] -= 100.0  # experts 6 and 7 receive no token
    routing = get_router("softmax_topk")(logits, TOP_K, False)
    want = moe_reference(x, routing, w13, w2)
    got = fused_moe(*(t.to(DEVICE) for t in (x, routing.experts, routing.weights, w13, w2))).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
