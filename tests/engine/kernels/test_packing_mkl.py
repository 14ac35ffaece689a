"""Weights packed once for MKL (kernels/packing/mkl.py) against ``F.linear``, and when they are used.

The packed GEMM runs MKL's own kernels over a copy made once: its output equals
``F.linear``'s up to float32 summation order (MKL may split the sums another way, e.g.
across threads, or take a matrix-vector kernel for one row); on SmolLM2's shapes at 2
threads it was equal bit for bit.
A torch build without MKL's pack API (aarch64, macOS) skips the numeric tests; the
fallback tests still run.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine.kernels.linear import resolve_linear
from kvfleet.engine.kernels.native.skinny_gemm import SKINNY_MAX_ROWS
from kvfleet.engine.kernels.packing import mkl
from kvfleet.engine.kernels.packing.mkl import MklPackedWeight

from .conftest import linear_case

needs_mkl = pytest.mark.skipif(not MklPackedWeight.available(), reason="this torch build has no MKL pack API")
# float32 sums in another order: relative to the size of the terms
TOL = dict(rtol=1e-4, atol=1e-4)


def packed_of(weight: torch.Tensor) -> MklPackedWeight:
    packed = MklPackedWeight.pack(weight)
    assert packed is not None
    return packed


@needs_mkl
@pytest.mark.parametrize("rows", [1, 17, 100, 513])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (64, 1), (37, 33), (8, 49)])
def test_the_packed_matmul_equals_f_linear(threads: int, rows: int, k: int, n: int) -> None:
    x, weight, _ = linear_case(rows, k, n)
    with torch.inference_mode():
        torch.testing.assert_close(packed_of(weight)(x, None), F.linear(x, weight), **TOL)


@needs_mkl
def test_a_bias_is_added_to_every_row() -> None:
    x, weight, bias = torch.randn(40, 24), torch.randn(10, 24), torch.randn(10)
    with torch.inference_mode():
        out = packed_of(weight)(x, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), **TOL)


@needs_mkl
def test_it_takes_only_contiguous_float32_cpu_rows_of_its_width_without_grad() -> None:
    packed = packed_of(torch.randn(8, 16))
    with torch.inference_mode():
        assert packed.takes(torch.randn(20, 16))
        assert not packed.takes(torch.randn(20, 17))  # another width
        assert not packed.takes(torch.randn(16, 20).t())  # not contiguous
        assert not packed.takes(torch.randn(20, 16, dtype=torch.float64))
        assert not packed.takes(torch.randn(2, 20, 16))  # not one flat batch
        assert not packed.takes(torch.randn(0, 16))
    assert not packed.takes(torch.randn(20, 16))  # grad mode on: F.linear keeps autograd


def test_only_float32_cpu_matrices_are_packed() -> None:
    assert MklPackedWeight.pack(torch.randn(8, 16, dtype=torch.bfloat16)) is None
    assert MklPackedWeight.pack(torch.randn(8)) is None


def test_without_the_pack_api_nothing_is_packed() -> None:
    with mock.patch.object(mkl, "_mkl", return_value=None):
        assert MklPackedWeight.pack(torch.randn(8, 16)) is None
        assert not MklPackedWeight.available()


@needs_mkl
def test_a_decode_batch_keeps_the_plain_weight_and_a_prefill_chunk_takes_the_pack() -> None:
    # The pack is of another weight, so the output says which operand the call read.
    # (Both weights' products differ by far more than any summation order.)
    weight, other = torch.randn(32, 16), torch.randn(32, 16)
    packed = packed_of(other)
    few, many = torch.randn(SKINNY_MAX_ROWS, 16), torch.randn(SKINNY_MAX_ROWS + 1, 16)
    with torch.inference_mode():
        torch.testing.assert_close(resolve_linear(weight, None, packed)(few), F.linear(few, weight))
        torch.testing.assert_close(resolve_linear(weight, None, packed)(many), F.linear(many, other), **TOL)
        torch.testing.assert_close(resolve_linear(weight)(many), F.linear(many, weight), **TOL)
