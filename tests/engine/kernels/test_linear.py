"""The native few-row matmul (csrc/skinny_gemm.c) against ``F.linear``, and when it is used.

Built with the machine's C compiler like the decode kernel (one library); with no compiler
the native tests skip and the fallback tests still run.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine.kernels import linear
from kvfleet.engine.kernels.linear import few_rows, resolve_linear, skinny_weight
from kvfleet.engine.kernels.native.skinny_gemm import SKINNY_MAX_ROWS, NativeLinear, load_linear

from .conftest import linear_case, needs_compiler

# float32 sums in another order than MKL's: relative to the size of the terms
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture
def native() -> NativeLinear:
    kernel = load_linear()
    assert kernel is not None, "a C compiler is present but the linear kernel did not build"
    return kernel


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 15, 16])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (64, 1), (37, 33), (8, 49)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_every_row_count_and_ragged_shape_matches_f_linear(
    native: NativeLinear, threads: int, rows: int, k: int, n: int, bias: bool
) -> None:
    x, weight, some_bias = linear_case(rows, k, n)
    b = some_bias if bias else None
    torch.testing.assert_close(native(x, weight, b), F.linear(x, weight, b), **TOL)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_an_outputs_bits_do_not_depend_on_the_block_its_weight_row_falls_in(
    native: NativeLinear, rows: int
) -> None:
    # 4 or 2 weight rows a block, the last n mod 4 (or 2) one at a time: the same sums lane for lane
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 45, generator=gen), torch.randn(35, 45, generator=gen)
    whole = native(x, weight, None)
    for j in range(35):
        assert torch.equal(native(x, weight[j : j + 1], None), whole[:, j : j + 1]), j


@needs_compiler
def test_each_output_is_written_once_whatever_was_in_the_buffer(native: NativeLinear) -> None:
    x, weight = torch.randn(4, 40), torch.randn(70, 40)
    with mock.patch.object(torch.Tensor, "new_empty", lambda self, *s: torch.full(s, float("nan"))):
        out = native(x, weight, None)
    torch.testing.assert_close(out, F.linear(x, weight), **TOL)


@needs_compiler
def test_a_decode_batch_goes_native_and_a_prefill_chunk_goes_to_torch(
    native: NativeLinear,
) -> None:
    weight = torch.randn(32, 16)
    with torch.inference_mode(), mock.patch.object(linear.F, "linear", wraps=F.linear) as torch_linear:
        resolve_linear(weight)(torch.randn(SKINNY_MAX_ROWS, 16))
        assert torch_linear.call_count == 0
        resolve_linear(weight)(torch.randn(SKINNY_MAX_ROWS + 1, 16))
        assert torch_linear.call_count == 1


@pytest.mark.parametrize(
    "case",
    ["transposed weight", "float64", "strided input", "grad enabled", "3-d input"],
)
def test_what_the_kernel_cannot_take_falls_back_to_f_linear_with_the_same_result(case: str) -> None:
    x, weight, bias = torch.randn(4, 24), torch.randn(10, 24), torch.randn(10)
    if case == "transposed weight":
        weight = weight.t().contiguous().t()
    elif case == "float64":
        x, weight, bias = x.double(), weight.double(), bias.double()
    elif case == "strided input":
        x = torch.randn(4, 48)[:, ::2]
    elif case == "3-d input":
        x = x[None]
    grad = case == "grad enabled"
    with torch.set_grad_enabled(grad):
        assert not (skinny_weight(weight, bias) and few_rows(x, weight.shape[1]))
        torch.testing.assert_close(resolve_linear(weight, bias)(x), F.linear(x, weight, bias))


def test_without_the_native_library_every_call_is_f_linear() -> None:
    x, weight = torch.randn(2, 8), torch.randn(3, 8)
    with torch.inference_mode(), mock.patch.object(linear, "load_linear", return_value=None):
        torch.testing.assert_close(resolve_linear(weight)(x), F.linear(x, weight))
