"""gpt-oss's mixture of experts: the ``topk_softmax`` router against transformers' ``GptOssTopKRouter``,
the grouped compute with biases and the clamped SwiGLU (gate/up interleaved) against the per-token
torch reference at 1, 7 and 64 tokens with experts that receive no token, and both against
transformers' own ``GptOssExperts`` (its eager loop) on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

from kvfleet.engine.layers.moe import Activation, Routing, StackedExperts, get_router, grouped_moe
from kvfleet.engine.layers.moe.reference import moe_reference

from .moe_routing import skewed_logits_routing

E, TOP_K, H, INTER = 8, 2, 64, 32
CLAMPED = Activation("clamped_swiglu", 1.702, 7.0)


def weights(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(E, H, 2I), (E, 2I), (E, I, H), (E, H): transformers' layout, large enough to reach the clamp."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(E, H, 2 * INTER, generator=g) * 1.5,
        torch.randn(E, 2 * INTER, generator=g),
        torch.randn(E, INTER, H, generator=g) * 0.1,
        torch.randn(E, H, generator=g) * 0.1,
    )


def routing(tokens: int, seed: int = 1) -> Routing:
    """gpt-oss's router (softmax over the top k) never picking experts 5-7."""
    return skewed_logits_routing("topk_softmax", tokens, experts=E, top_k=TOP_K, renormalize=False, seed=seed)


def test_the_topk_softmax_router_equals_transformers_gpt_oss_router() -> None:
    config = GptOssConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=TOP_K)
    router = GptOssTopKRouter(config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.normal_(generator=g)
        router.bias.normal_(generator=g)
    x = torch.randn(9, H, generator=g)
    _, want_weights, want_experts = router(x)
    got = get_router("topk_softmax")(torch.nn.functional.linear(x, router.weight, router.bias), TOP_K, False)
    assert torch.equal(got.experts, want_experts)
    torch.testing.assert_close(got.weights, want_weights.float())
    torch.testing.assert_close(got.weights.sum(-1), torch.ones(9))  # a softmax over the top-k alone


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_biased_clamped_experts_equal_the_per_token_reference(tokens: int) -> None:
    gate_up, b13, down, b2 = weights()
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(3))
    r = routing(tokens)
    got = grouped_moe(x, r, StackedExperts(gate_up.transpose(1, 2), down.transpose(1, 2), b13, b2), CLAMPED)
    want = moe_reference(x, r, gate_up.transpose(1, 2), down.transpose(1, 2), b13, b2, clamped=(1.702, 7.0))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    pre = torch.einsum("th,ehi->tei", x, gate_up) + b13
    assert bool((pre[..., 0::2] > 7.0).any()) and bool((pre[..., 1::2].abs() > 7.0).any()), "meant to clamp"


def test_grouped_experts_equal_transformers_gpt_oss_experts_on_its_weights() -> None:
    config = GptOssConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=TOP_K
    )
    config._experts_implementation = "eager"  # transformers' own loop over the experts
    experts = GptOssExperts(config)
    gate_up, b13, down, b2 = weights(4)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.gate_up_proj_bias.copy_(b13)
        experts.down_proj.copy_(down)
        experts.down_proj_bias.copy_(b2)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(5))
    r = routing(7, seed=6)
    want = experts(x, r.experts, r.weights)
    got = grouped_moe(x, r, StackedExperts(gate_up.transpose(1, 2), down.transpose(1, 2), b13, b2), CLAMPED)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_unknown_activation_is_an_error_naming_the_registered_ones() -> None:
    gate_up, _, down, _ = weights()
    with pytest.raises(ValueError, match="clamped_swiglu"):
        grouped_moe(
            torch.zeros(1, H),
            routing(1),
            StackedExperts(gate_up.transpose(1, 2), down.transpose(1, 2)),
            Activation("gelu"),
        )
