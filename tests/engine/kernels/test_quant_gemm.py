"""The quantised CPU matmul (csrc/quant_gemm.c) against gguf's numpy dequantiser.

Two references per case: the exact one (the weight dequantised by ``gguf.quants.dequantize``
against the activations quantised as the kernel quantises them: only float rounding apart), and
the float32 one (the format's error plus the int8 activations', a loose bound). Blocks of the
K-quants are random bytes with sane f16 scales (gguf's numpy quantiser has no K-quants)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvfleet.engine.kernels.native.quant_gemm import BLOCK_LAYOUTS, QuantKernelError, QuantWeight, load_quant

native = load_quant()
pytestmark = pytest.mark.skipif(native is None, reason="the native library does not build here")

FORMATS = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # f16 fields of each block


def make_blocks(fmt: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row bytes) uint8 blocks: quantised from normal weights, or random K-quant blocks."""
    if fmt not in SCALE_OFFSETS:
        return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, fmt)
    per_block, size = BLOCK_LAYOUTS[int(fmt)]
    raw = rng.integers(0, 256, size=(n, k // per_block, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[fmt]:
        scales = rng.uniform(1e-4, 1e-3, size=(n, k // per_block)).astype(np.float16)
        raw[:, :, off : off + 2] = scales.view(np.uint8).reshape(n, k // per_block, 2)
    return raw.reshape(n, -1)


def quantize_activations(x: np.ndarray) -> np.ndarray:
    """x as the kernel sees it: int8 per 32 with scale amax / 127, dequantised."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(b).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * d).reshape(x.shape)


def run(fmt: Q, m: int, n: int, k: int, portable: bool, bias: bool = False) -> tuple[np.ndarray, ...]:
    assert native is not None
    rng = np.random.default_rng(m * 1000 + n + int(fmt))
    blocks = make_blocks(fmt, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if bias else None
    weight = QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks)), int(fmt), k)
    out = native(torch.from_numpy(x), weight.blocks, weight.ggml_type, b, portable=portable).numpy()
    w = dequantize(blocks, fmt).astype(np.float64).reshape(n, k)
    extra = 0.0 if b is None else b.numpy().astype(np.float64)
    exact = quantize_activations(x).astype(np.float64) @ w.T + extra
    return out, exact, x.astype(np.float64) @ w.T + extra


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 67])
@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
def test_each_format_matches_the_dequantised_weight(fmt: Q, m: int, portable: bool) -> None:
    k = 512 if fmt in SCALE_OFFSETS else 96
    out, exact, ref = run(fmt, m, 37, k, portable)
    assert out.shape == (m, 37)
    np.testing.assert_allclose(out, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    assert _rel(out, ref) < 0.02  # int8 activations: about 1% of the float32 product


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_prefill_shape_with_bias_and_odd_out_size(fmt: Q) -> None:
    out, exact, _ = run(fmt, 130, 45, 768, portable=False, bias=True)
    np.testing.assert_allclose(out, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_avx2_path_agrees_with_the_portable_one(fmt: Q) -> None:
    assert native is not None
    if not native.has_avx2:
        pytest.skip("this build has no AVX2 path")
    best, _, _ = run(fmt, 6, 29, 256, portable=False)
    portable, _, _ = run(fmt, 6, 29, 256, portable=True)
    np.testing.assert_allclose(best, portable, rtol=1e-5, atol=1e-5 * np.abs(portable).max())


def test_zero_rows_of_activations_give_zero() -> None:
    assert native is not None
    blocks = make_blocks(Q.Q4_1, 8, 64, np.random.default_rng(0))
    out = native(torch.zeros(2, 64), torch.from_numpy(blocks), int(Q.Q4_1))
    assert out.shape == (2, 8) and not out.any()


def test_a_row_length_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(QuantKernelError, match="not 100 values"):
        QuantWeight(torch.zeros(4, 72, dtype=torch.uint8), int(Q.Q4_1), 100)
    with pytest.raises(QuantKernelError, match="no quantised kernel"):
        QuantWeight(torch.zeros(4, 72, dtype=torch.uint8), int(Q.Q5_0), 64)
