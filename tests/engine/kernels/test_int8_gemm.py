"""The per-channel int8 CPU matmul (csrc/int8_gemm.c) against torch references.

Two references: the exact one (per-token int8 activations and the int8 weights multiplied in
float64, as the kernel's integer dots are exact: only float rounding apart), and the float32 one
(int8's error on both sides, a loose bound)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.kernels.int8_linear import (
    ONEDNN_MIN_ROWS,
    Int8Linear,
    onednn_int8_linear,
    resolve_int8_linear,
)
from kvfleet.engine.kernels.native import int8_gemm
from kvfleet.engine.kernels.native.cpu_features import probe_cpu_paths
from kvfleet.engine.kernels.native.quant_gemm import PATHS, choose_path

native = int8_gemm.load_int8()
pytestmark = pytest.mark.skipif(native is None, reason="the native library does not build here")
HERE = native.paths if native is not None else ()
PATH = [pytest.param(p, marks=pytest.mark.skipif(p not in HERE, reason=f"no {p} here")) for p in PATHS]


def emulated(x: torch.Tensor, w: int8_gemm.Int8Weight) -> torch.Tensor:
    dx = x.abs().amax(dim=1, keepdim=True) / 127.0
    qx = torch.round(x / torch.where(dx > 0, dx, torch.ones_like(dx)))
    return (qx.double() @ w.qweight.double().T * dx.double() * w.scale.double()).float()


@pytest.mark.parametrize("path", PATH)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 48), (5, 200, 33), (9, 576, 96), (4, 1536, 17)])
def test_the_kernel_is_the_exact_int8_product_and_near_the_float_one(
    path: str, m: int, k: int, n: int
) -> None:
    assert native is not None
    g = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    q = int8_gemm.quantize_per_channel(w)
    out = native(x, q, bias, path=path)
    torch.testing.assert_close(out, emulated(x, q) + bias, rtol=1e-5, atol=1e-5)
    ref = x @ w.T + bias
    assert ((out - ref).norm() / (ref - bias).norm()).item() < 0.02


def test_every_path_here_takes_the_same_integer_dots_as_the_portable_one() -> None:
    assert native is not None
    x = torch.randn(7, 333)
    w = int8_gemm.quantize_per_channel(torch.randn(40, 333))  # a k with a 64-byte tail
    x[2] = 0.0  # a zero row: no offset left over on the VNNI path
    x[3, :] = torch.where(torch.arange(333) % 2 == 0, 1.0, -1.0) * 9.0  # every int8 at +-127
    portable = native(x, w, path="portable")
    for path in native.paths:
        torch.testing.assert_close(native(x, w, path=path), portable, rtol=1e-6, atol=1e-6)
        for row in (2, 3):  # one row alone: VNNI's 16-weight-row pass (40 = 16 + 16 + 8 rows)
            torch.testing.assert_close(native(x[row : row + 1], w, path=path), portable[row : row + 1])


def test_the_chosen_path_is_the_fastest_this_cpu_offers_and_a_missing_one_is_refused() -> None:
    assert native is not None
    assert native.path == choose_path(native.paths, probe_cpu_paths())
    if "avx512_vnni" in probe_cpu_paths().flags and probe_cpu_paths().isa == "avx512_vnni":
        assert native.path == "avx512_vnni"
    missing = [p for p in PATHS if p not in native.paths] + [
        "amx_int8"
    ]  # never a native path: always refused
    for path in missing:
        with pytest.raises(int8_gemm.Int8KernelError, match="does not run here"):
            native(torch.randn(1, 32), int8_gemm.quantize_per_channel(torch.randn(4, 32)), path=path)


def test_per_channel_quantisation_keeps_each_rows_amax_and_dequantises_within_half_a_step() -> None:
    w = torch.randn(16, 64)
    w[3] = 0.0
    q = int8_gemm.quantize_per_channel(w)
    assert q.qweight.abs().amax(dim=1)[torch.arange(16) != 3].eq(127).all()
    assert q.scale[3] == 1.0 and q.qweight[3].eq(0).all()
    assert ((q.dequantised() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()
    assert q.nbytes == 16 * 64 + 16 * 4


def test_a_zero_activation_row_gives_the_bias() -> None:
    assert native is not None
    q = int8_gemm.quantize_per_channel(torch.randn(8, 32))
    bias = torch.arange(8.0)
    assert torch.equal(native(torch.zeros(2, 32), q, bias), bias.expand(2, 8))


def test_a_width_mismatch_and_a_malformed_weight_are_refused() -> None:
    assert native is not None
    with pytest.raises(int8_gemm.Int8KernelError, match="columns"):
        native(torch.randn(2, 31), int8_gemm.quantize_per_channel(torch.randn(4, 32)))
    with pytest.raises(int8_gemm.Int8KernelError, match="scale"):
        int8_gemm.Int8Weight(torch.zeros(4, 32, dtype=torch.int8), torch.ones(3))


def test_the_resolved_linear_keeps_the_input_shape_and_dtype() -> None:
    linear = resolve_int8_linear(int8_gemm.quantize_per_channel(torch.randn(24, 64)))
    assert isinstance(linear, Int8Linear)
    out = linear(torch.randn(2, 3, 64, dtype=torch.bfloat16))
    assert out.shape == (2, 3, 24) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("m", [ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 37])
def test_the_linear_takes_the_same_int8_product_below_and_from_the_onednn_row_count(m: int) -> None:
    assert native is not None
    g = torch.Generator().manual_seed(m)
    x, w, bias = (
        torch.randn(m, 200, generator=g),
        torch.randn(24, 200, generator=g),
        torch.randn(24, generator=g),
    )
    x[0] = 0.0
    q = int8_gemm.quantize_per_channel(w)
    out = resolve_int8_linear(q, bias)(x)
    torch.testing.assert_close(out, emulated(x, q) + bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(onednn_int8_linear(x, q, bias), native(x, q, bias), rtol=1e-6, atol=1e-6)
