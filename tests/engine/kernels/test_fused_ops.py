"""The native fused ops (residual add + RMSNorm, SiLU * up) against their torch reference.

Built with the machine's C compiler like the decode kernel (one library); with no compiler
the native tests skip and the fallback tests still run.
"""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.kernels import fused_ops
from kvfleet.engine.kernels.native.fused_ops import NativeFused

from .conftest import needs_compiler

# float32: only the order of the sum of squares differs from torch's, a few ulp
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture
def native() -> NativeFused:
    kernel = fused_ops.load_fused()
    assert kernel is not None, "a C compiler is present but the fused ops did not build"
    return kernel


@needs_compiler
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 64), (513, 576), (64, 1000)])
def test_the_native_add_and_norm_equals_torch_and_writes_the_sum_into_the_residual(
    native: NativeFused, threads: int, rows: int, hidden: int
) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g) * 3
    residual = torch.randn(rows, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)
    want_norm, want_sum = fused_ops.add_rms_norm_reference(x, residual, weight, 1e-5)
    stream = residual.clone()
    got_norm = native.add_rms_norm(x, stream, weight, 1e-5)
    torch.testing.assert_close(stream, want_sum, rtol=0, atol=0)  # the add itself is exact
    torch.testing.assert_close(got_norm, want_norm, **TOL)


@needs_compiler
def test_the_native_norm_without_an_add_leaves_the_residual_alone(native: NativeFused) -> None:
    residual = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * 100
    kept = residual.clone()
    got = native.add_rms_norm(None, residual, torch.ones(96), 1e-6)
    torch.testing.assert_close(residual, kept, rtol=0, atol=0)
    torch.testing.assert_close(
        got, fused_ops.add_rms_norm_reference(None, kept, torch.ones(96), 1e-6)[0], **TOL
    )


@needs_compiler
@pytest.mark.parametrize(("rows", "inner"), [(1, 1536), (3, 40), (300, 1536)])
def test_the_native_silu_times_up_equals_torch(
    native: NativeFused, threads: int, rows: int, inner: int
) -> None:
    gate_up = torch.randn(rows, 2 * inner, generator=torch.Generator().manual_seed(rows)) * 6
    torch.testing.assert_close(native.silu_mul(gate_up), fused_ops.silu_mul_reference(gate_up), **TOL)


@needs_compiler
def test_silu_stays_finite_and_exact_at_extreme_gates(native: NativeFused) -> None:
    gates = torch.tensor([[-1e4, -100.0, -88.5, -20.0, -1e-8, 0.0, 1e-8, 20.0, 88.5, 100.0, 1e4, 3.0]])
    gate_up = torch.cat([gates, torch.full_like(gates, 0.5)], dim=1)
    got = native.silu_mul(gate_up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, fused_ops.silu_mul_reference(gate_up), **TOL)


def test_tensors_the_native_ops_cannot_read_take_the_torch_path() -> None:
    """bfloat16, a non-contiguous view, a 3-d batch: the reference's result, the residual untouched."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(64, generator=g)
    for residual in (
        torch.randn(4, 64, generator=g).bfloat16(),
        torch.randn(64, 8, generator=g).t(),
        torch.randn(2, 3, 64, generator=g),
    ):
        w = weight.to(residual.dtype)[: residual.shape[-1]]
        kept = residual.clone()
        norm, total = fused_ops.add_rms_norm(residual, residual, w, 1e-5)
        want_norm, want_total = fused_ops.add_rms_norm_reference(kept, kept, w, 1e-5)
        torch.testing.assert_close(norm, want_norm, rtol=0, atol=0)
        torch.testing.assert_close(total, want_total, rtol=0, atol=0)
        torch.testing.assert_close(residual, kept, rtol=0, atol=0)
    gate_up = torch.randn(5, 16, generator=g).bfloat16()
    torch.testing.assert_close(
        fused_ops.silu_mul(gate_up), fused_ops.silu_mul_reference(gate_up), rtol=0, atol=0
    )


def test_without_the_library_every_op_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_ops, "load_fused", lambda: None)
    g = torch.Generator().manual_seed(4)
    x, residual, weight = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g), torch.randn(32)
    kept = residual.clone()
    norm, total = fused_ops.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(total, x + kept, rtol=0, atol=0)
    torch.testing.assert_close(residual, kept, rtol=0, atol=0)
    torch.testing.assert_close(
        norm, fused_ops.add_rms_norm_reference(x, kept, weight, 1e-5)[0], rtol=0, atol=0
    )


@needs_compiler
@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "head_dim"), [(1, 9, 3, 64), (300, 9, 3, 64), (5, 4, 1, 32)]
)
def test_the_native_rope_rotates_the_q_and_k_heads_of_the_packed_rows_in_place_and_leaves_v(
    native: NativeFused, threads: int, rows: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    g = torch.Generator().manual_seed(rows + heads)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g)
    angles = torch.rand(rows, head_dim // 2, generator=g) * 1000
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    kept = qkv.clone()
    qk = qkv[:, : (heads + kv_heads) * head_dim].unflatten(1, (heads + kv_heads, head_dim))
    want = fused_ops.apply_rope_reference(qk.clone(), cos, sin)
    got = fused_ops.apply_rope(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr(), "rotated in place"
    torch.testing.assert_close(got, want, **TOL)
    v_cols = slice((heads + kv_heads) * head_dim, None)
    torch.testing.assert_close(qkv[:, v_cols], kept[:, v_cols], rtol=0, atol=0)


def test_rope_on_rows_the_native_op_cannot_read_takes_the_torch_path() -> None:
    """An odd head size, a transposed view, bfloat16: a new tensor from the reference, x untouched."""
    g = torch.Generator().manual_seed(5)
    for x, dim in (
        (torch.randn(3, 2, 5, generator=g), 5),
        (torch.randn(2, 3, 8, generator=g).transpose(0, 1), 8),
        (torch.randn(3, 2, 8, generator=g).bfloat16(), 8),
    ):
        cos, sin = torch.randn(3, dim, generator=g).to(x.dtype), torch.randn(3, dim, generator=g).to(x.dtype)
        kept = x.clone()
        got = fused_ops.apply_rope(x, cos, sin)
        torch.testing.assert_close(got, fused_ops.apply_rope_reference(kept, cos, sin), rtol=0, atol=0)
        torch.testing.assert_close(x, kept, rtol=0, atol=0)
