"""fp8 (e4m3) linears on a GPU at Llama-3-8B's shapes, against the dequantised weight in float32.
Skipped without a CUDA device of compute capability >= 8.9 (what ``torch._scaled_mm`` takes)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.kernels.fp8_linear import Fp8Linear, quantize_fp8_per_channel, resolve_fp8_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA device of compute capability >= 8.9",
    ),
]

# (out, in) of Llama-3-8B's packed q/k/v, o_proj, packed gate/up and down_proj
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("rows", [1, 7, 128])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_fp8_linear_matches_the_dequantised_weight_within_e4m3_activation_error(
    n: int, k: int, rows: int
) -> None:
    torch.manual_seed(n + k + rows)
    weight = torch.randn(n, k, device="cuda") * 0.02
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    q = quantize_fp8_per_channel(weight)
    linear = resolve_fp8_linear(q, bias, torch.bfloat16)
    assert isinstance(linear, Fp8Linear)
    ref = x.float() @ q.dequantised(torch.float32).t() + bias.float()
    out = linear(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # e4m3 keeps 3 mantissa bits: each activation is off by <= 1/16 of itself, about 3.6% rms
    assert _relative_error(out, ref) < 0.06


def test_the_ada_path_with_unit_scales_gives_what_the_rowwise_path_gives() -> None:
    torch.manual_seed(0)
    q = quantize_fp8_per_channel(torch.randn(4096, 4096, device="cuda") * 0.02)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    rowwise, ada = Fp8Linear(q, None, rowwise=True), Fp8Linear(q, None, rowwise=False)
    assert _relative_error(ada(x), rowwise(x).float()) < 0.01


def test_an_fp8_linear_replays_inside_a_cuda_graph() -> None:
    torch.manual_seed(1)
    q = quantize_fp8_per_channel(torch.randn(4096, 4096, device="cuda") * 0.02)
    linear = resolve_fp8_linear(q, None, torch.bfloat16)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    linear(x)  # warm-up outside the capture, as the engine's capture does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, linear(x))
