"""The LoRA kernel: each token's adapter delta added to a projection's output slice, one launch per module.

Where it sits: ``LoraContext.add`` (``engine/lora/context.py``) calls :func:`add_lora` on CUDA
right after the base matmul, once per targeted module of a layer; the torch path there
(``lora_delta``) is its oracle in the tests (under ``TRITON_INTERPRET=1`` on the CPU).

Work split (bgmv, as vLLM's punica kernels for decode): the grid is (token, output tile). A
program reads its token's slot; slot 0 (the base model) returns at once. Otherwise it computes
the shrink ``v = A[slot] · x`` (R values, over the input in tiles of BLOCK_K) and adds
``v · B[slot][:, tile]`` to its tile of the output row. The shrink is recomputed per output
tile: R · in multiply-adds, small beside the tile's R · BLOCK_N · (out / BLOCK_N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Invariant: after the loop over input tiles [0, k0), v[r] = sum_{k < k0} A[slot, r, k] x[t, k];
# rows r >= RANK (padding to a power of two) stay 0; the store adds exactly sum_r v[r] B[slot, r, n].
@triton.jit
def _lora_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    slots_ptr,
    fan_in,
    fan_out,
    stride_xt,
    stride_as,
    stride_ar,
    stride_bs,
    stride_br,
    stride_ot,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot == 0:
        return
    r = tl.arange(0, RANK_PAD)
    r_ok = r < RANK
    v = tl.zeros((RANK_PAD,), dtype=tl.float32)
    for k0 in range(0, fan_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < fan_in
        xk = tl.load(x_ptr + t * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
            mask=r_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        v += tl.sum(a * xk[None, :], axis=1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < fan_out
    b = tl.load(
        b_ptr + slot * stride_bs + r[:, None] * stride_br + n[None, :],
        mask=r_ok[:, None] & n_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(v[:, None] * b, axis=0)
    row = out_ptr + t * stride_ot + n
    base = tl.load(row, mask=n_ok, other=0.0)
    tl.store(row, (base.to(tl.float32) + delta).to(base.dtype), mask=n_ok)


def add_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[t] += (x[t] @ a[slot_t].T) @ b[slot_t]`` for each token with slot > 0, in place.

    x: (T, in); a: (slots, R, in); b: (slots, R, out); token_slots: (T,) int; out: (T, out), a
    column slice of a wider tensor is fine (its rows may be strided, its columns must be contiguous).
    """
    num_tokens, fan_in = x.shape
    fan_out = out.shape[1]
    if num_tokens == 0:
        return
    for name, t in (("x", x), ("a", a), ("b", b), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"add_lora: {name} must have contiguous columns, got strides {t.stride()}")
    rank = a.shape[1]
    block_n = 64
    grid = (num_tokens, triton.cdiv(fan_out, block_n))
    _lora_kernel[grid](
        x,
        a,
        b,
        out,
        token_slots,
        fan_in,
        fan_out,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        RANK=rank,
        RANK_PAD=max(16, triton.next_power_of_2(rank)),
        BLOCK_K=64,
        BLOCK_N=block_n,
    )
