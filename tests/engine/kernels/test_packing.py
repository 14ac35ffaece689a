"""Which GEMM library the packed linears run on (kernels/packing), and oneDNN's packed path against ``F.linear``.

``auto`` times each packer the build has on a weight of the model and keeps the faster; a
name runs that packer. oneDNN's packed matmul (kernels/packing/onednn.py) equals ``F.linear``
up to float32 summation order, with and without a bias, at decode and prefill row counts.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine.kernels import packing
from kvfleet.engine.kernels.packing.mkl import MklPackedWeight
from kvfleet.engine.kernels.packing.native import NativePackedWeight
from kvfleet.engine.kernels.packing.onednn import OnednnPackedWeight, bf16_available

from .conftest import assert_packed_is_f_linear, linear_case

needs_onednn = pytest.mark.skipif(
    not OnednnPackedWeight.available(), reason="this torch build has no oneDNN linear"
)
TOL = dict(
    rtol=1e-4, atol=5e-4
)  # float32 sums of up to 1536 unit-normal products (|out| ~ 40) in another order


@needs_onednn
@pytest.mark.parametrize("rows", [1, 17, 100, 513])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (64, 1), (37, 33)])
def test_the_onednn_packed_matmul_equals_f_linear(threads: int, rows: int, k: int, n: int) -> None:
    x, weight, bias = linear_case(rows, k, n)
    packed = OnednnPackedWeight.pack(weight)
    assert packed is not None and (packed.out_features, packed.in_features) == (n, k)
    assert_packed_is_f_linear(packed, x, weight, bias, TOL)


@pytest.mark.parametrize("kind", sorted(packing.PACKERS))
def test_every_packers_pack_is_a_copy_later_changes_to_the_weight_do_not_reach_it(kind: str) -> None:
    x, weight = torch.randn(20, 16), torch.randn(8, 16)
    packed = packing.pack_weight(weight, kind)
    if packed is None:
        pytest.skip(f"this build cannot pack for {kind}")
    expected = F.linear(x, weight)
    weight.zero_()
    with torch.inference_mode():
        torch.testing.assert_close(packed(x, None), expected, **TOL)


def test_onednn_packs_only_float32_cpu_matrices_and_bf16_ones_where_it_computes_bf16() -> None:
    assert OnednnPackedWeight.pack(torch.ones(4, 4, dtype=torch.float16)) is None
    packed_bf16 = OnednnPackedWeight.pack(torch.ones(4, 4, dtype=torch.bfloat16))
    assert (packed_bf16 is not None) == bf16_available()
    assert OnednnPackedWeight.pack(torch.ones(4)) is None


@needs_onednn
def test_a_packed_weight_takes_only_contiguous_float32_rows_of_its_width() -> None:
    packed = OnednnPackedWeight.pack(torch.ones(8, 4))
    assert packed is not None
    with torch.inference_mode():
        assert packed.takes(torch.ones(3, 4))
        assert not packed.takes(torch.ones(3, 5))
        assert not packed.takes(torch.ones(4, 3).t())
        assert not packed.takes(torch.ones(3, 4, dtype=torch.float64))
        assert not packed.takes(torch.ones(0, 4))


def test_a_named_packer_is_used_as_named_and_an_unknown_one_packs_nothing() -> None:
    sample = torch.ones(16, 8)
    assert packing.resolve("mkl", sample) == "mkl"
    assert packing.resolve("onednn", sample) == "onednn"
    assert packing.resolve("native", sample) == "native"
    assert packing.resolve("blis", sample) is None


def test_auto_keeps_the_fastest_packer_by_its_measured_time() -> None:
    times = {"mkl": 2.0, "onednn": 1.0, "native": 3.0}
    with mock.patch.object(packing, "_seconds", side_effect=lambda packed, x: times[kind_of(packed)]):
        if MklPackedWeight.available() and OnednnPackedWeight.available() and NativePackedWeight.available():
            assert packing.resolve("auto", torch.ones(16, 8)) == "onednn"
            times.update(mkl=0.5)
            assert packing.resolve("auto", torch.ones(16, 8)) == "mkl"
            times.update(native=0.25)
            assert packing.resolve("auto", torch.ones(16, 8)) == "native"


@pytest.mark.skipif(
    not (OnednnPackedWeight.available() and NativePackedWeight.available()), reason="needs oneDNN and native"
)
def test_auto_keeps_native_within_its_margin_for_the_one_call_decode_its_panels_also_run() -> None:
    times = {"mkl": 2.0, "onednn": 1.0, "native": 1.0 * packing.NATIVE_MARGIN}
    with mock.patch.object(packing, "_seconds", side_effect=lambda packed, x: times[kind_of(packed)]):
        assert packing.resolve("auto", torch.ones(16, 8)) == "native"
        times.update(native=1.2)
        assert packing.resolve("auto", torch.ones(16, 8)) == "onednn"


def test_auto_packs_nothing_where_no_packer_takes_the_weight() -> None:
    with mock.patch.dict(packing.PACKERS, {name: mock.Mock(pack=lambda w: None) for name in packing.PACKERS}):
        assert packing.resolve("auto", torch.ones(16, 8)) is None


def kind_of(packed: object) -> str:
    if isinstance(packed, MklPackedWeight):
        return "mkl"
    return "native" if isinstance(packed, NativePackedWeight) else "onednn"
