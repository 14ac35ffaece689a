"""The Triton fused ops (residual add + RMSNorm, RoPE, SiLU × up) against their torch reference.

Under the interpreter on the CPU here, compiled on a GPU (the same tests, ``device`` fixture).
In float32 only the last bits of rsqrt and exp differ; in bf16 and fp16 the norm and SiLU round
where torch rounds, so nearly every element is equal and the others are one ulp apart; RoPE
rounds once, so it equals the float32 rotation rounded, and transformers' thrice-rounded one
to a few ulp of its inputs.
Triton's interpreter truncates to bf16 (numpy has no bf16) where a compiled kernel rounds to
nearest as torch does: on the CPU bf16 is checked to one ulp, on a GPU to the bit.
"""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.kernels import fused_ops as cpu_fused
from kvfleet.engine.kernels.triton import fused_ops as triton_fused

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one ulp of each dtype, relative: the most a differently rounded rsqrt or exp moves a result
ULP = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def rounds_to_nearest(t: torch.Tensor) -> bool:
    """Whether a kernel's stores to ``t`` round to nearest (not the interpreter's bf16 truncation)."""
    return t.is_cuda or t.dtype != torch.bfloat16


def assert_equal_but_for_the_last_bit(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    got32, want32 = got.float(), want.float()
    ulps = 1 if rounds_to_nearest(got) else 2
    torch.testing.assert_close(got32, want32, rtol=ulps * ULP[got.dtype], atol=ulps * ULP[got.dtype])
    if got.dtype != torch.float32 and rounds_to_nearest(got):
        assert (got32 == want32).float().mean() >= 0.97, "half precision rounds where torch rounds"


def randn(
    *shape: int, dtype: torch.dtype, device: torch.device, seed: int, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "hidden", "x_stride"), [(1, 576, 576), (7, 64, 64), (33, 1000, 1536)])
def test_the_add_and_norm_writes_the_exact_sum_into_the_residual_and_the_norm_of_it(
    device: torch.device, dtype: torch.dtype, rows: int, hidden: int, x_stride: int
) -> None:
    x = randn(rows, x_stride, dtype=dtype, device=device, seed=1, scale=3.0)[:, :hidden]  # rows at a stride
    residual = randn(rows, hidden, dtype=dtype, device=device, seed=2)
    weight = randn(hidden, dtype=dtype, device=device, seed=3)
    want_norm, want_sum = cpu_fused.add_rms_norm_reference(x, residual, weight, 1e-5)
    stream = residual.clone()
    got_norm, got_sum = triton_fused.add_rms_norm(x, stream, weight, 1e-5)
    assert got_sum is stream, "the sum is written into the residual stream in place"
    if rounds_to_nearest(stream):
        torch.testing.assert_close(stream, want_sum, rtol=0, atol=0)
    else:
        assert_equal_but_for_the_last_bit(stream, want_sum)
    assert_equal_but_for_the_last_bit(got_norm, want_norm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_norm_without_an_add_leaves_the_residual_alone(device: torch.device, dtype: torch.dtype) -> None:
    residual = randn(5, 96, dtype=dtype, device=device, seed=4, scale=50.0)
    kept = residual.clone()
    weight = randn(96, dtype=dtype, device=device, seed=5)
    got, same = triton_fused.add_rms_norm(None, residual, weight, 1e-6)
    torch.testing.assert_close(residual, kept, rtol=0, atol=0)
    assert same is residual
    assert_equal_but_for_the_last_bit(got, cpu_fused.add_rms_norm_reference(None, kept, weight, 1e-6)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (4, 4, 32)])
def test_rope_rotates_the_q_and_k_heads_of_the_packed_qkv_in_place(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    tokens = 11
    qkv = randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, device=device, seed=heads)
    angles = randn(tokens, head_dim // 2, dtype=torch.float32, device=device, seed=7, scale=3.0)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    before = qkv.clone()
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    once = [cpu_fused.apply_rope_reference(t.float(), cos.float(), sin.float()).to(dtype) for t in (q, k)]
    thrice = [cpu_fused.apply_rope_reference(t.clone(), cos, sin) for t in (q, k)]
    assert triton_fused.rope_(q, cos, sin).data_ptr() == q.data_ptr()
    triton_fused.rope_(k, cos, sin)
    for got, want, theirs in zip((q, k), once, thrice, strict=True):
        assert_equal_but_for_the_last_bit(got, want)
        # transformers rounds x*cos and x2*sin before their sum: a few ulp of the inputs apart
        scale = float(before.abs().max()) * ULP[dtype] * 4
        torch.testing.assert_close(got.float(), theirs.float(), rtol=0, atol=scale)
    torch.testing.assert_close(qkv[:, heads + kv_heads :], before[:, heads + kv_heads :], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "m"), [(1, 1536), (6, 1000), (3, 3000)])
def test_silu_mul_equals_silu_of_the_gate_times_the_up_half(
    device: torch.device, dtype: torch.dtype, rows: int, m: int
) -> None:
    gate_up = randn(rows, 2 * m, dtype=dtype, device=device, seed=m, scale=4.0)
    assert_equal_but_for_the_last_bit(triton_fused.silu_mul(gate_up), cpu_fused.silu_mul_reference(gate_up))


def test_an_empty_step_launches_nothing_and_returns_empty_tensors(device: torch.device) -> None:
    empty = torch.empty(0, 64, device=device)
    norm, _ = triton_fused.add_rms_norm(empty, empty.clone(), torch.ones(64, device=device), 1e-6)
    assert norm.shape == (0, 64)
    assert triton_fused.silu_mul(torch.empty(0, 128, device=device)).shape == (0, 64)
    assert triton_fused.rope_(torch.empty(0, 2, 64, device=device), empty, empty).shape == (0, 2, 64)
