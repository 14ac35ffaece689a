"""FP8 (e4m3) weights with one scale per output row, and the linear that runs them on a GPU.

Where it sits: ``engine/loader/hf_quant.py`` keeps each linear of a compressed-tensors FP8
checkpoint (or of a float checkpoint served with ``--quantization fp8`` on a GPU) as an
:class:`Fp8Weight` and resolves it with :func:`resolve_fp8_linear`. On a GPU of compute capability
8.9 or more (Ada, Hopper) :class:`Fp8Linear` quantises each token's activations to e4m3 with its
own scale (amax / 448) and calls ``torch._scaled_mm`` with unit scales, the outer product of the
(m, 1) token scales and the (1, n) channel scales applied after. On an H100 that call took 6.2-43.5 us
per decode-shaped matmul where the row-wise-scaled one took 15.1-50.6 (bench/results/gpu_h100.txt's
probe: 1.1-2.4x slower at every Llama-3-8B shape, 1-128 rows), so every fp8 GPU takes it; row-wise
scales stay available (``rowwise=True``) and are tested equal within 1%. Elsewhere (a CPU, an older GPU, a shape ``_scaled_mm`` does not take: dimensions not multiples
of 16) the weight is dequantised once to the compute dtype and runs as a float linear — correct,
the memory saving gone — which the loader logs as a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.engine.kernels.linear import Linear, TorchLinear
from kvfleet.engine.kernels.operand import NativeOperand
from kvfleet.engine.kernels.row_scaled import RowScaledWeight

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True, slots=True)
class Fp8Weight(RowScaledWeight):
    """``qweight`` (out, in) float8_e4m3fn and ``scale`` (out,) float32: w = scale * q."""

    def __post_init__(self) -> None:
        if self.qweight.dtype != E4M3 or self.qweight.dim() != 2:
            raise ValueError(f"fp8 weights must be 2-d float8_e4m3fn, got {self.qweight.dtype}")
        self.check_scale(ValueError)

    def dequantised(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)


def quantize_fp8_per_channel(weight: torch.Tensor) -> Fp8Weight:
    """Symmetric per-output-row e4m3: scale = amax / 448 (1 for an all-zero row), q = w / scale."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Weight(q.contiguous(), scale.contiguous())


def concat_fp8(weights: list[Fp8Weight]) -> Fp8Weight:
    """The rows of ``weights`` stacked (q/k/v or gate/up as one matmul), each row with its scale."""
    return Fp8Weight(
        torch.cat([w.qweight for w in weights]).contiguous(), torch.cat([w.scale for w in weights])
    )


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` runs ``torch._scaled_mm`` on e4m3: a CUDA GPU of compute capability >= 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_tokens_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` (m, k) to e4m3 with its own scale: (q (m, k), scale (m, 1) float32)."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp_(min=1e-12)
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


@dataclass(frozen=True, slots=True)
class Fp8Linear:
    """``x @ (scale * q)^T + bias`` through ``torch._scaled_mm`` (per-token activation scales)."""

    weight: Fp8Weight
    bias: torch.Tensor | None
    rowwise: bool  # True: _scaled_mm applies both scales; False: unit scales, the outer product after

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_tokens_fp8(flat)
        wt = self.weight.qweight.t()  # (k, n) column-major: the layout _scaled_mm takes for mat2
        if self.rowwise:
            out = torch._scaled_mm(
                xq, wt, scale_a=xs, scale_b=self.weight.scale.view(1, -1), out_dtype=torch.bfloat16
            )
        else:
            one = torch.ones((), device=x.device, dtype=torch.float32)
            out = torch._scaled_mm(xq, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            out = out * (xs * self.weight.scale.view(1, -1))
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.weight.out_features)

    def native_operand(self) -> NativeOperand | None:
        return None  # a GPU's _scaled_mm: no native CPU call


def scaled_mm_takes(weight: Fp8Weight) -> bool:
    """``_scaled_mm`` needs both of the weight's dimensions to be multiples of 16."""
    n, k = weight.qweight.shape
    return n % 16 == 0 and k % 16 == 0


def resolve_fp8_linear(weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
    """``_scaled_mm`` on an fp8 GPU for the shapes it takes; else the weight dequantised to ``dtype``."""
    device = weight.qweight.device
    if fp8_supported(device) and scaled_mm_takes(weight):
        return Fp8Linear(weight, bias, rowwise=False)  # unit scales: the faster call (see the docstring)
    return TorchLinear(weight.dequantised(dtype), bias)
