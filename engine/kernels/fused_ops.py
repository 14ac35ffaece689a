"""Fused element-wise ops of the decoder (``csrc/fused_ops.c``), with their torch reference as fallback.

Where it sits: the model (``engine/model/llama.py``) calls :func:`add_rms_norm` for each
RMSNorm (with the residual add in front of it), :func:`apply_rope` on the q and k heads of
the packed q/k/v output, and :func:`silu_mul` between the packed gate/up matmul and the down
projection. On float32 CPU tensors they run the native ops, compiled into the decode kernel's
library (``native/build.py``: one build, one cache); on CUDA tensors the Triton ops
of :mod:`kvfleet.engine.kernels.triton.fused_ops`; otherwise, or where no C compiler builds the
library or Triton is not installed, they run the ``*_reference`` functions, transformers'
arithmetic in torch, which are also the oracle of both kinds of ops in the tests.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from kvfleet.engine.kernels.native.fused_ops import load_fused


def add_rms_norm_reference(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), RMSNorm as transformers computes it (float32 statistics)."""
    hidden = residual if x is None else x + residual
    dtype = hidden.dtype
    h32 = hidden.float()
    h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h32.to(dtype), hidden


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos/sin: (T, head_dim). transformers' rotate-half RoPE."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


@functools.cache
def load_triton_fused() -> ModuleType | None:
    """The Triton ops (imported on the first CUDA tensor only), or None where Triton is missing."""
    try:
        from kvfleet.engine.kernels.triton import fused_ops as triton_fused
    except ImportError:
        return None
    return triton_fused


def _cuda_rows(t: torch.Tensor | None, like: torch.Tensor) -> bool:
    """A 2-D CUDA tensor on ``like``'s device, in its dtype, with contiguous rows (any row stride)."""
    return t is None or (
        t.dim() == 2 and t.stride(1) == 1 and t.device == like.device and t.dtype == like.dtype
    )


def _native_ok(*tensors: torch.Tensor | None) -> bool:
    return all(
        t is None
        or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.dim() <= 2)
        for t in tensors
    )


def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); x None: (norm(residual), residual).

    Natively, the sum is written into ``residual`` in place: the caller owns it (the model's
    residual stream, made by the first layer's add and carried through the layers).
    """
    if residual.is_cuda:
        ops = load_triton_fused()
        same = x is None or x.shape == residual.shape
        w_ok = weight.is_contiguous() and weight.device == residual.device and weight.dtype == residual.dtype
        if ops is not None and same and w_ok and _cuda_rows(residual, residual) and _cuda_rows(x, residual):
            return ops.add_rms_norm(x, residual, weight, eps)  # type: ignore[no-any-return]
        return add_rms_norm_reference(x, residual, weight, eps)
    kernel = load_fused()
    if kernel is None or residual.dim() != 2 or not _native_ok(x, residual, weight):
        return add_rms_norm_reference(x, residual, weight, eps)
    return kernel.add_rms_norm(x, residual, weight, eps), residual


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by RoPE; natively in place (x: a view of heads packed in rows, e.g. the q/k heads
    of the packed q/k/v output, which the caller owns), else a new tensor."""
    packed = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.shape[2] % 2 == 0
    if x.is_cuda:
        ops = load_triton_fused()
        trig = all(t.is_contiguous() and t.shape == (x.shape[0], x.shape[2]) for t in (cos, sin))
        if ops is not None and packed and trig and _cuda_rows(cos, x) and _cuda_rows(sin, x):
            return ops.rope_(x, cos, sin)  # type: ignore[no-any-return]
        return apply_rope_reference(x, cos, sin)
    kernel = load_fused()
    if (
        kernel is None
        or not packed
        or not _native_ok(cos, sin)
        or x.dtype != torch.float32
        or x.device != cos.device
    ):
        return apply_rope_reference(x, cos, sin)
    return kernel.rope_(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last axis times its second half (the packed gate/up output)."""
    if gate_up.is_cuda:
        ops = load_triton_fused()
        if ops is not None and _cuda_rows(gate_up, gate_up) and gate_up.shape[1] % 2 == 0:
            return ops.silu_mul(gate_up)  # type: ignore[no-any-return]
        return silu_mul_reference(gate_up)
    kernel = load_fused()
    if kernel is None or gate_up.dim() != 2 or not _native_ok(gate_up):
        return silu_mul_reference(gate_up)
    return kernel.silu_mul(gate_up)
