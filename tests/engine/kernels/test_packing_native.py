"""The native packed GEMM (kernels/packing/native.py, native/csrc/packed_gemm.c) against ``F.linear``.

The weight is copied once into panels of 16 output columns, k-major, zero past the last
column; the kernel keeps 6 rows x 16 columns of the output in registers and sums each output
in index order. So it equals ``F.linear`` up to float32 summation order at any row count
(the micro-kernel's row remainders, the L2 row blocks, a column count that is not a whole
panel, with and without a bias, on 1-3 threads), and a row's output does not depend on the
other rows of the batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine.kernels.linear import resolve_linear
from kvfleet.engine.kernels.native.skinny_gemm import SKINNY_MAX_ROWS
from kvfleet.engine.kernels.packing.native import NativePackedWeight

from .conftest import assert_packed_is_f_linear, linear_case

pytestmark = pytest.mark.skipif(
    not NativePackedWeight.available(), reason="the native library does not build here"
)
TOL = dict(rtol=1e-4, atol=5e-4)  # float32 sums of up to 1536 unit-normal products in another order


def packed_of(weight: torch.Tensor) -> NativePackedWeight:
    packed = NativePackedWeight.pack(weight)
    assert packed is not None
    return packed


def test_the_panels_hold_16_columns_k_major_and_zeros_past_the_last_column() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)  # 20 columns: 2 panels
    panels = packed_of(weight).panels.reshape(2, 3, 16)
    assert torch.equal(panels[0], weight[:16].t())
    assert torch.equal(panels[1, :, :4], weight[16:].t())
    assert torch.equal(panels[1, :, 4:], torch.zeros(3, 12))


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 17, 32, 100, 513])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (64, 1), (37, 33), (8, 49)])
def test_the_packed_matmul_equals_f_linear(threads: int, rows: int, k: int, n: int) -> None:
    x, weight, bias = linear_case(rows, k, n)
    packed = packed_of(weight)
    assert (packed.out_features, packed.in_features) == (n, k)
    assert_packed_is_f_linear(packed, x, weight, bias, TOL)


def test_a_rows_output_is_the_same_bits_whatever_else_is_in_the_batch(threads: int) -> None:
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(200, 1536, generator=gen), torch.randn(50, 1536, generator=gen)
    packed = packed_of(weight)
    with torch.inference_mode():
        whole = packed(x, None)
        for start, stop in ((0, 1), (3, 10), (37, 200), (199, 200)):
            assert torch.equal(packed(x[start:stop].contiguous(), None), whole[start:stop])


def test_only_float32_cpu_matrices_are_packed_and_only_their_rows_are_taken() -> None:
    assert NativePackedWeight.pack(torch.ones(4, 4, dtype=torch.bfloat16)) is None
    assert NativePackedWeight.pack(torch.ones(4)) is None
    packed = packed_of(torch.ones(8, 4))
    with torch.inference_mode():
        assert packed.takes(torch.ones(3, 4))
        assert not packed.takes(torch.ones(3, 5))
        assert not packed.takes(torch.ones(4, 3).t())
        assert not packed.takes(torch.ones(3, 4, dtype=torch.float64))


def test_a_decode_step_of_any_size_takes_the_native_pack_not_the_few_row_kernel() -> None:
    # The pack is of another weight, so the output says which operand the call read.
    weight, other = torch.randn(32, 16), torch.randn(32, 16)
    packed = packed_of(other)
    assert packed.streams_few_rows
    with torch.inference_mode():
        for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(resolve_linear(weight, None, packed)(x), F.linear(x, other), **TOL)
