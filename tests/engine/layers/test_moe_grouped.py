"""The mixture-of-experts router and the grouped expert compute against the plain per-token torch
reference (``layers/moe/reference.py``) at 1, 7 and 64 tokens, with experts that receive no token,
over float experts and over the int8 and GGUF-block linear methods."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvfleet.engine.kernels.native.quant_gemm import QuantWeight, load_quant
from kvfleet.engine.layers.linear import get_method
from kvfleet.engine.layers.moe import KernelExperts, Routing, StackedExperts, get_router, grouped_moe
from kvfleet.engine.layers.moe.grouped import group_by_expert
from kvfleet.engine.layers.moe.reference import moe_reference

from .moe_routing import skewed_logits_routing

E, TOP_K, H, INTER = 8, 2, 64, 32
TOKENS = (1, 7, 64)


def expert_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g) * 0.1, torch.randn(E, H, INTER, generator=g) * 0.1


def skewed_routing(tokens: int) -> Routing:
    """The softmax router (renormalised top k) never picking experts 5-7."""
    return skewed_logits_routing("softmax_topk", tokens, experts=E, top_k=TOP_K, renormalize=True)


def test_the_softmax_router_keeps_the_top_k_and_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    plain = get_router("softmax_topk")(logits, 2, False)
    assert plain.experts.tolist() == [[1, 2]]
    torch.testing.assert_close(plain.weights, probs[:, [1, 2]])
    renorm = get_router("softmax_topk")(logits, 2, True)
    torch.testing.assert_close(renorm.weights, probs[:, [1, 2]] / probs[:, [1, 2]].sum())


def test_an_unknown_router_name_is_an_error_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="softmax_topk"):
        get_router("sigmoid")


def test_grouping_sorts_assignments_by_expert_and_counts_empty_experts() -> None:
    routing = Routing(torch.tensor([[3, 0], [0, 3], [1, 3]]), torch.arange(6.0).reshape(3, 2))
    groups = group_by_expert(routing, 5)
    assert groups.counts == [2, 1, 0, 3, 0]
    assert groups.token_of.tolist() == [0, 1, 2, 0, 1, 2]
    assert groups.weight_of.tolist() == [1.0, 2.0, 4.0, 0.0, 3.0, 5.0]


@pytest.mark.parametrize("tokens", TOKENS)
def test_grouped_float_experts_equal_the_per_token_reference(tokens: int) -> None:
    w13, w2 = expert_weights()
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    routing = skewed_routing(tokens)
    assert set(routing.experts.flatten().tolist()) <= set(range(5))
    got = grouped_moe(x, routing, StackedExperts(w13, w2))
    torch.testing.assert_close(got, moe_reference(x, routing, w13, w2), rtol=1e-5, atol=1e-5)


def test_no_rows_give_no_rows() -> None:
    w13, w2 = expert_weights()
    got = grouped_moe(torch.empty(0, H), skewed_routing(0), StackedExperts(w13, w2))
    assert got.shape == (0, H)


@pytest.mark.parametrize("tokens", TOKENS)
def test_int8_experts_equal_the_reference_over_their_dequantised_weights(tokens: int) -> None:
    w13, w2 = expert_weights(2)
    method = get_method("int8")
    gates = [method.quantize(w13[e, :INTER]) for e in range(E)]  # type: ignore[attr-defined]
    ups = [method.quantize(w13[e, INTER:]) for e in range(E)]  # type: ignore[attr-defined]
    downs = [method.quantize(w2[e]) for e in range(E)]  # type: ignore[attr-defined]
    experts = KernelExperts.load(method, gates, ups, downs)
    dq13 = torch.stack([torch.cat([gates[e].dequantised(), ups[e].dequantised()]) for e in range(E)])
    dq2 = torch.stack([d.dequantised() for d in downs])
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    routing = skewed_routing(tokens)
    # the kernel also quantises each token's activations to int8: about 1% of a row's magnitude
    torch.testing.assert_close(
        grouped_moe(x, routing, experts), moe_reference(x, routing, dq13, dq2), rtol=0.03, atol=0.01
    )


def _blocks(w: torch.Tensor, fmt: Q) -> QuantWeight:
    return QuantWeight(torch.from_numpy(quantize(w.numpy(), fmt)), int(fmt), w.shape[1])


def _dequantised(q: QuantWeight, fmt: Q, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(q.blocks.numpy(), fmt)).reshape(-1, cols))


@pytest.mark.skipif(load_quant() is None, reason="the native GGUF library does not build here")
@pytest.mark.parametrize("fmt", (Q.Q8_0, Q.Q4_1), ids=lambda f: f.name)
@pytest.mark.parametrize("tokens", TOKENS)
def test_gguf_block_experts_equal_the_reference_over_their_dequantised_blocks(fmt: Q, tokens: int) -> None:
    w13, w2 = expert_weights(3)
    gates = [_blocks(w13[e, :INTER], fmt) for e in range(E)]
    ups = [_blocks(w13[e, INTER:], fmt) for e in range(E)]
    downs = [_blocks(w2[e], fmt) for e in range(E)]
    experts = KernelExperts.load(get_method("gguf"), gates, ups, downs)
    dq13 = torch.stack(
        [torch.cat([_dequantised(gates[e], fmt, H), _dequantised(ups[e], fmt, H)]) for e in range(E)]
    )
    dq2 = torch.stack([_dequantised(d, fmt, INTER) for d in downs])
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    routing = skewed_routing(tokens)
    # activations quantised to int8 per 32 by the kernel, as the dense GGUF path does
    torch.testing.assert_close(
        grouped_moe(x, routing, experts), moe_reference(x, routing, dq13, dq2), rtol=0.03, atol=0.01
    )
