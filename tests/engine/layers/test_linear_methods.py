"""Each linear method of ``engine/layers/linear`` (float, packed float, int8, gguf, fp8): its apply
(the resolved kernel's call) against a plain torch reference on small shapes, its embedding against
the rows it holds, and the native operand it offers the one-call decode.

The references: float and packed float, ``F.linear`` on the stacked weights; int8, the weight
dequantised (scale * q) against the activations quantised per token as the kernel quantises them;
gguf, ``gguf.quants.dequantize``'d blocks against activations quantised per 32; fp8 on the CPU,
the weight dequantised at load (what the method runs there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvfleet.engine.kernels.int8_linear import ONEDNN_MIN_ROWS, quantize_tokens
from kvfleet.engine.kernels.native.decode_layers import INT8_CHANNEL
from kvfleet.engine.kernels.native.int8_gemm import load_int8
from kvfleet.engine.kernels.native.quant_gemm import QuantWeight, load_quant
from kvfleet.engine.kernels.native.skinny_gemm import SKINNY_MAX_ROWS, load_linear
from kvfleet.engine.kernels.packing.native import NativePackedWeight
from kvfleet.engine.layers.linear import get_method, native_operand, registered
from kvfleet.engine.layers.linear.gguf_blocks import Parts

K = 64  # two Q8_0/Q4_1 blocks per row
ROWS = (1, 3, SKINNY_MAX_ROWS + 1, 40)  # decode rows, the few-row kernel's limit passed, a prefill


def weights(*outs: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, K, generator=g) * 0.1 for n in outs]


def inputs(rows: int) -> torch.Tensor:
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))


def bias_of(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(7))


def test_every_format_is_registered_by_name() -> None:
    assert registered() == ("bf16", "float", "fp8", "gguf", "int8", "packed")
    with pytest.raises(ValueError, match="no linear method 'awq'"):
        get_method("awq")


@pytest.mark.parametrize("rows", ROWS)
def test_float_apply_is_f_linear_on_the_stacked_weights(rows: int) -> None:
    ws, b = weights(32, 16, 16), bias_of(64)
    method = get_method("float")
    kernel = method.load(ws, b)
    x = inputs(rows)
    torch.testing.assert_close(method.apply(kernel, x), F.linear(x, torch.cat(ws), b), rtol=1e-5, atol=1e-5)
    op = method.native_operand(kernel)
    if load_linear() is not None:  # the few-row kernel's rows, up to its row count
        assert op is not None and op.kind == "rows" and op.max_rows == SKINNY_MAX_ROWS
        assert torch.equal(op.weight, torch.cat(ws)) and op.bias is b


@pytest.mark.skipif(not NativePackedWeight.available(), reason="the native GEMM does not build here")
@pytest.mark.parametrize("rows", ROWS)
def test_packed_float_apply_is_f_linear_and_offers_its_panels(rows: int) -> None:
    (w,), b = weights(48), bias_of(48)
    kernel = get_method("packed").load([w], b)
    x = inputs(rows)
    torch.testing.assert_close(kernel(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    op = native_operand(kernel)
    assert op is not None and op.kind == "panels" and op.max_rows is None


@pytest.mark.skipif(load_int8() is None, reason="the native library does not build here")
@pytest.mark.parametrize("rows", (*ROWS, ONEDNN_MIN_ROWS))
def test_int8_apply_is_the_dequantised_weight_on_per_token_int8_activations(rows: int) -> None:
    method = get_method("int8")
    ws, b = weights(32, 16), bias_of(48)
    kernel = method.load([method.quantize(w) for w in ws], b)
    x = inputs(rows)
    q, dx = quantize_tokens(x)
    dequantised = torch.cat([method.quantize(w).dequantised() for w in ws])
    reference = F.linear(q.float() * dx, dequantised, b)
    torch.testing.assert_close(kernel(x), reference, rtol=1e-4, atol=1e-4)
    op = native_operand(kernel)
    assert op is not None and (op.kind, op.type, op.max_rows) == ("quant", INT8_CHANNEL, ONEDNN_MIN_ROWS - 1)


def quant_blocks(w: torch.Tensor, fmt: Q) -> QuantWeight:
    return QuantWeight(torch.from_numpy(quantize(w.numpy(), fmt)), int(fmt), K)


def per_32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the GGUF kernel sees it: int8 per 32 with scale amax / 127, dequantised."""
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return (torch.round(b * inv) * d).reshape(x.shape)


@pytest.mark.skipif(load_quant() is None, reason="the native library does not build here")
@pytest.mark.parametrize("fmt", (Q.Q8_0, Q.Q4_1), ids=lambda f: f.name)
@pytest.mark.parametrize("rows", ROWS)
def test_gguf_apply_is_the_dequantised_blocks_on_int8_activations_per_32(fmt: Q, rows: int) -> None:
    ws, b = weights(32, 16, 16, seed=int(fmt)), bias_of(64)
    blocks = [quant_blocks(w, fmt) for w in ws]
    kernel = get_method("gguf").load(blocks, b)
    dequantised = torch.from_numpy(
        np.concatenate([dequantize(q.blocks.numpy(), fmt).reshape(-1, K) for q in blocks])
    )
    x = inputs(rows)
    torch.testing.assert_close(kernel(x), F.linear(per_32(x), dequantised, b), rtol=1e-4, atol=1e-4)
    op = native_operand(kernel)
    assert op is not None and (op.kind, op.type, op.max_rows) == ("quant", int(fmt), None)


@pytest.mark.skipif(load_quant() is None, reason="the native library does not build here")
def test_gguf_linears_of_mixed_formats_run_one_call_each_and_offer_no_native_operand() -> None:
    method = get_method("gguf")
    q, k = weights(32, 16, seed=3)
    blocks = quant_blocks(q, Q.Q8_0)
    b = bias_of(48)
    assert isinstance(method.create([blocks, k]), Parts)
    kernel = method.load([blocks, k], b)
    x = inputs(3)
    dq = torch.from_numpy(dequantize(blocks.blocks.numpy(), Q.Q8_0).reshape(-1, K))
    expected = torch.cat([F.linear(per_32(x), dq, b[:32]), F.linear(x, k, b[32:])], dim=-1)
    torch.testing.assert_close(kernel(x), expected, rtol=1e-4, atol=1e-4)
    assert native_operand(kernel) is None


def test_fp8_on_the_cpu_applies_the_weight_dequantised_at_load() -> None:
    method = get_method("fp8", torch.float32)
    ws, b = weights(32, 16), bias_of(48)
    fp8 = [method.quantize(w) for w in ws]
    kernel = method.load(fp8, b)
    x = inputs(3)
    dequantised = torch.cat([method.dequantised(w) for w in fp8])
    torch.testing.assert_close(kernel(x), F.linear(x, dequantised, b), rtol=0, atol=0)
    assert native_operand(kernel) is None  # a GPU's _scaled_mm, or torch's GEMM here


@pytest.mark.parametrize("name", ["float", "int8", "fp8", "gguf"])
def test_each_embedding_returns_the_rows_it_holds_in_the_compute_dtype(name: str) -> None:
    if name == "gguf" and load_quant() is None:
        pytest.skip("the native library does not build here")
    method = get_method(name, torch.float32)
    (w,) = weights(40)
    ids = torch.tensor([[0, 5], [39, 5]])
    if name == "float":
        stored, expected = w, w
    elif name == "int8" or name == "fp8":
        stored = method.quantize(w)  # type: ignore[attr-defined]
        expected = stored.dequantised() if name == "int8" else stored.dequantised(torch.float32)
    else:
        blocks = quant_blocks(w, Q.Q8_0)
        stored = method.shared(blocks)  # type: ignore[attr-defined]
        expected = torch.from_numpy(dequantize(blocks.blocks.numpy(), Q.Q8_0).reshape(-1, K))
    rows = method.embedding(stored)(ids)
    assert rows.dtype == torch.float32 and rows.shape == (2, 2, K)
    torch.testing.assert_close(rows, expected[ids], rtol=0, atol=0)


@pytest.mark.skipif(load_int8() is None, reason="the native library does not build here")
def test_resident_bytes_count_what_each_format_keeps() -> None:
    (w,) = weights(32)
    assert get_method("float").resident_bytes(get_method("float").load([w], None)) == 32 * K * 4
    int8 = get_method("int8")
    assert int8.resident_bytes(int8.load([int8.quantize(w)], None)) == 32 * K + 32 * 4
