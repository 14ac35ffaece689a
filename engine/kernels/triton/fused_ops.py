"""The decoder's fused element-wise ops on a GPU, in Triton: residual add + RMSNorm, RoPE, SiLU × up.

Where it sits: ``engine/kernels/fused_ops.py``'s ``add_rms_norm``, ``apply_rope`` and
``silu_mul`` (which the model calls) send CUDA tensors here, as they send float32 CPU tensors
to the native C ops. One launch replaces the torch ops of each reference (``*_reference``
there, transformers' arithmetic: about eight for the norm, five for RoPE, two for SiLU × up),
and on a GPU a small model's step is bound by launches, not by the device
(bench/results/gpu_h200.txt).

The norm and SiLU × up round where the reference rounds: every value torch stores in the
activations' dtype (bf16, fp16) is rounded to it here too, so in half precision they equal the
reference but for the last bit of a float32 rsqrt or exp. RoPE computes each rotated pair in
float32 and rounds once (transformers rounds both products and their sum: up to a few ulp
apart where the two products cancel), as the native CPU op does. On a GPU in bf16 that moves
near-ties: SmolLM2's first token for "What is the capital of France?" is "The" at -1.883
against "L" at -1.965 (float32 logprobs), and either can win in bf16. They run under Triton's
interpreter on the CPU (the tests) as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Invariant: residual[row] holds x[row] + residual[row] rounded to its dtype before the norm reads it.
@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    n,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HAS_X: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dt = res_ptr.dtype.element_ty
    h = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if HAS_X:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + x.to(tl.float32)).to(dt)
        tl.store(res_ptr + row * stride_r + cols, h, mask=mask)
    h32 = h.to(tl.float32)
    var = tl.sum(h32 * h32, axis=0) / n
    normed = (h32 * tl.rsqrt(var + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


# Invariant: for each head, out = x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1),
# computed in float32 and rounded to x's dtype once, written over x.
@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_x,
    stride_c,
    heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    d_ok = d < HALF
    mask = (h < heads) & d_ok
    dt = x_ptr.dtype.element_ty
    first = x_ptr + t * stride_x + h * (2 * HALF) + d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    trig = t * stride_c + d
    c1 = tl.load(cos_ptr + trig, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + trig + HALF, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + trig, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + trig + HALF, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(first, (x1 * c1 - x2 * s1).to(dt), mask=mask)
    tl.store(first + HALF, (x2 * c2 + x1 * s2).to(dt), mask=mask)


# Invariant: out[row, j] = silu(gate[row, j]) * up[row, j], silu rounded to the dtype first.
@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, m, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < m
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + m + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(dt), mask=mask)


def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), the sum written into ``residual`` in place (rows, n)."""
    rows, n = residual.shape
    out = torch.empty_like(residual)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            residual if x is None else x,
            residual,
            weight,
            out,
            n,
            residual.stride(0) if x is None else x.stride(0),
            residual.stride(0),
            out.stride(0),
            eps,
            HAS_X=x is not None,
            BLOCK=triton.next_power_of_2(n),
        )
    return out, residual


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (T, heads, D: heads and D packed, rows at any stride) in place; cos/sin (T, D)."""
    rows, heads, dim = x.shape
    if rows:
        _rope_kernel[(rows,)](
            x,
            cos,
            sin,
            x.stride(0),
            cos.stride(0),
            heads,
            HALF=dim // 2,
            BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_D=triton.next_power_of_2(dim // 2),
        )
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the packed (rows, 2m) gate/up output, as a new (rows, m) tensor."""
    rows, m = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, m)
    block = min(1024, triton.next_power_of_2(m))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(m, block))](
            gate_up, out, m, gate_up.stride(0), out.stride(0), BLOCK=block
        )
    return out
