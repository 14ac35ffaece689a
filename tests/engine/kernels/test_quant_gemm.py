"""The quantised CPU matmul (csrc/quant_gemm.c, quant_vnni.c) on its repacked layout (quant_pack.c)
against gguf's numpy dequantiser, path by path: portable always, AVX2 and AVX-512 VNNI where the CPU
has them (skipped with the reason elsewhere).

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

from kvfleet.engine.kernels.native.cpu_features import probe_cpu_paths
from kvfleet.engine.kernels.native.quant_gemm import (
    BLOCK_LAYOUTS,
    PATHS,
    QuantKernelError,
    QuantWeight,
    load_quant,
)

native = load_quant()
pytestmark = pytest.mark.skipif(native is None, reason="the native library does not build here")

FORMATS = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # f16 fields of each block
CPU_FLAG = {"avx2": "avx2", "avx512_vnni": "avx512_vnni"}


def need(path: str) -> None:
    """Skip unless this build and CPU run ``path``, saying which of the two lacks it."""
    assert native is not None
    if path in native.paths:
        return
    flag = CPU_FLAG[path]
    if flag not in probe_cpu_paths().flags:
        pytest.skip(f"this CPU has no {path} path: /proc/cpuinfo lists no {flag}")
    pytest.skip(f"the library was built without the {path} path")


def make_blocks(fmt: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row bytes) uint8 blocks: quantised from normal weights, or random K-quant blocks."""
    if fmt not in SCALE_OFFSETS:
        return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, fmt)
    per_block, size = BLOCK_LAYOUTS[int(fmt)]
    raw = rng.integers(0, 256, size=(n, k // per_block, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[fmt]:
        scales = rng.uniform(1e-4, 1e-3, size=(n, k // per_block)).astype(np.float16)
        raw[:, :, off : off + 2] = scales.view(np.uint8).reshape(n, k // per_block, 2)
    return np.ascontiguousarray(raw.reshape(n, -1))


def quantize_activations(x: np.ndarray) -> np.ndarray:
    """x as the kernel sees it: int8 per 32 with scale amax / 127, dequantised."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(b).max(axis=2, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(b * inv) * d).reshape(x.shape)


def run(fmt: Q, m: int, n: int, k: int, path: str, bias: bool = False) -> tuple[np.ndarray, ...]:
    assert native is not None
    rng = np.random.default_rng(m * 1000 + n + int(fmt))
    blocks = make_blocks(fmt, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if bias else None
    weight = native.pack(QuantWeight(torch.from_numpy(blocks), int(fmt), k))
    out = native(torch.from_numpy(x), weight, b, path=path).numpy()
    w = dequantize(blocks, fmt).astype(np.float64).reshape(n, k)
    extra = 0.0 if b is None else b.numpy().astype(np.float64)
    exact = quantize_activations(x).astype(np.float64) @ w.T + extra
    return out, exact, x.astype(np.float64) @ w.T + extra


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m", range(1, 18))
@pytest.mark.parametrize("path", PATHS)
def test_each_path_and_format_matches_the_dequantised_weight_on_odd_shapes(fmt: Q, m: int, path: str) -> None:
    need(path)
    k = 512 if fmt in SCALE_OFFSETS else 96
    n = 37 if m % 2 else 45  # not a multiple of 4, 8 or 16 output rows
    out, exact, ref = run(fmt, m, n, k, path)
    assert out.shape == (m, n)
    np.testing.assert_allclose(out, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    assert _rel(out, ref) < 0.02  # int8 activations: about 1% of the float32 product


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("path", PATHS)
def test_a_prefill_shape_with_bias_and_odd_out_size_matches_on_each_path(fmt: Q, path: str) -> None:
    need(path)
    out, exact, _ = run(fmt, 130, 45, 768, path, bias=True)
    np.testing.assert_allclose(out, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("path", ["avx2", "avx512_vnni"])
def test_the_vector_paths_agree_with_the_portable_one(fmt: Q, path: str) -> None:
    need(path)
    best, _, _ = run(fmt, 6, 29, 256, path)
    portable, _, _ = run(fmt, 6, 29, 256, "portable")
    np.testing.assert_allclose(best, portable, rtol=1e-5, atol=1e-5 * np.abs(portable).max())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_repacking_keeps_every_byte_and_unpacked_rows_are_the_files(fmt: Q) -> None:
    assert native is not None
    blocks = make_blocks(fmt, 21, 512, np.random.default_rng(int(fmt)))
    weight = native.pack(QuantWeight(torch.from_numpy(blocks), int(fmt), 512))
    ids = torch.tensor([20, 0, 7, 16, 7])
    assert torch.equal(weight.rows(ids), torch.from_numpy(blocks)[ids])
    assert weight.nbytes <= 32 * blocks.shape[1] * 1.03  # 21 rows pad to 32: the layout adds <= 3%


def test_rows_outside_the_weight_are_refused() -> None:
    assert native is not None
    blocks = make_blocks(Q.Q4_1, 8, 64, np.random.default_rng(0))
    weight = native.pack(QuantWeight(torch.from_numpy(blocks), int(Q.Q4_1), 64))
    with pytest.raises(IndexError, match="outside"):
        weight.rows(torch.tensor([8]))


def test_zero_rows_of_activations_give_zero() -> None:
    assert native is not None
    blocks = make_blocks(Q.Q4_1, 8, 64, np.random.default_rng(0))
    weight = native.pack(QuantWeight(torch.from_numpy(blocks), int(Q.Q4_1), 64))
    out = native(torch.zeros(2, 64), weight)
    assert out.shape == (2, 8) and not out.any()


def test_a_row_length_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(QuantKernelError, match="not 100 values"):
        QuantWeight(torch.zeros(4, 72, dtype=torch.uint8), int(Q.Q4_1), 100)
    with pytest.raises(QuantKernelError, match="no quantised kernel"):
        QuantWeight(torch.zeros(4, 72, dtype=torch.uint8), int(Q.Q5_0), 64)
