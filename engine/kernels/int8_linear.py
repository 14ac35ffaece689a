"""An int8 linear resolved once, at load, to the callable that runs it (``linear.py``'s rule).

Where it sits: ``engine/model/int8_loader.py`` resolves each per-channel int8 weight
(``native/int8_gemm.py``'s :class:`Int8Weight`) with :func:`resolve_int8_linear` and hands the
result to the model's blocks; a step only calls it. The chain: the native int8 kernel for CPU
inputs where the library builds; else the weight dequantised to float32 once and ``F.linear``
(correct, but the memory saving is gone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.engine.kernels.linear import Linear, TorchLinear
from kvfleet.engine.kernels.native.int8_gemm import Int8Weight, NativeInt8, load_int8


@dataclass(frozen=True, slots=True)
class Int8Linear:
    """``x @ (scale * q)^T + bias`` on the native kernel (int8 activations per token)."""

    native: NativeInt8
    weight: Int8Weight
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        out = self.native(flat, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.weight.out_features).to(x.dtype)


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
