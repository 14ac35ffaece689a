"""An int8 linear resolved once, at load, to the callable that runs it (``linear.py``'s rule).

Where it sits: the int8 method (``layers/linear/int8.py``) resolves each per-channel int8 weight
(``native/int8_gemm.py``'s :class:`Int8Weight`) with :func:`resolve_int8_linear` and hands the
result to the model's blocks; a step only calls it. The chain: the native int8 kernel for CPU
inputs where the library builds; else the weight dequantised to float32 once and ``F.linear``
(correct, but the memory saving is gone).

Which kernel multiplies: at :data:`ONEDNN_MIN_ROWS` rows or more, ``torch._int_mm`` (oneDNN's
s8 GEMM, which runs on AMX-INT8 or AVX-512 VNNI where the CPU has them and blocks far better
than the native kernel: 2-10x at 16-256 rows in a probe here), on the same per-token int8
activations; below it the native kernel: a decode step's rows, which the one-call decode takes
without the ten or so torch ops a oneDNN matmul costs around it. The threshold is a judgement from
loaded probes (at 4 rows the per-op oneDNN step measured 27.9 ms, slower than float32's 22.9 ms), not
tuned on a quiet box; quiet, the one-call int8 step took 13.6 / 16.8 / 25.1 ms at 1 / 4 / 8 rows on an
AMD EPYC, and 8.7 / 15.2 / 22.8 ms on an Intel Xeon with the reworked VNNI kernel (bench/results/quant_speed.txt).
Both take the same exact int32 dots; the float scaling differs only in rounding order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.engine.kernels.linear import Linear, TorchLinear
from kvfleet.engine.kernels.native.decode_layers import INT8_CHANNEL
from kvfleet.engine.kernels.native.int8_gemm import Int8Weight, NativeInt8, load_int8
from kvfleet.engine.kernels.operand import NativeOperand

ONEDNN_MIN_ROWS = 16  # from this many rows on, torch._int_mm (oneDNN) multiplies


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` (m, k) float32 to int8 with its own scale, as int8_gemm.c does:
    dx = amax / 127, q = round(x * (1 / dx)) (0 for an all-zero row): (q, dx (m, 1))."""
    dx = x.abs().amax(dim=1, keepdim=True) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return torch.round(x * inv).to(torch.int8), dx


def onednn_int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` (m, k) float32 against ``weight`` through ``torch._int_mm`` (exact int32 dots)."""
    q, dx = quantize_tokens(x)
    out = torch._int_mm(q, weight.qweight.t()).float() * (dx * weight.scale)
    return out if bias is None else out.add_(bias)


@dataclass(frozen=True, slots=True)
class Int8Linear:
    """``x @ (scale * q)^T + bias`` on int8 activations per token: oneDNN from
    :data:`ONEDNN_MIN_ROWS` rows, the native kernel below."""

    native: NativeInt8
    weight: Int8Weight
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        if flat.shape[0] >= ONEDNN_MIN_ROWS:
            out = onednn_int8_linear(flat, self.weight, self.bias)
        else:
            out = self.native(flat, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.weight.out_features).to(x.dtype)

    def native_operand(self) -> NativeOperand | None:
        """int8 rows and their scales on the native kernel, below the rows oneDNN takes."""
        w = self.weight
        return NativeOperand(
            w.qweight, self.bias, "quant", INT8_CHANNEL, w.scale, self.native.path, ONEDNN_MIN_ROWS - 1
        )


def resolve_int8_linear(weight: Int8Weight, bias: torch.Tensor | None = None) -> Linear:
    """The native kernel where it builds; else the weight dequantised to float32 and ``F.linear``."""
    native = load_int8()
    if native is None:
        return TorchLinear(weight.dequantised(), bias)
    return Int8Linear(native, weight, bias)


def concat_int8(weights: list[Int8Weight]) -> Int8Weight:
    """The rows of ``weights`` stacked (q/k/v or gate/up as one matmul): each row keeps its scale."""
    return Int8Weight(
        torch.cat([w.qweight for w in weights]).contiguous(),
        torch.cat([w.scale for w in weights]).contiguous(),
    )
