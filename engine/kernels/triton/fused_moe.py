"""The mixture-of-experts experts on a GPU in Triton: two grouped GEMMs over the assignments sorted by expert.

Where it sits: ``layers/moe/grouped.py``'s :func:`grouped_moe` sends CUDA rows with float experts
(stacked ``w13`` (E, 2I, H), ``w2`` (E, H, I)) here, where the CPU runs one torch matmul per
expert. :func:`align_by_expert` sorts every (token, expert) assignment by expert and pads each
expert's run to a whole number of ``BLOCK_M`` rows, so each program's rows belong to one expert,
named per block; experts without tokens get no block. The first GEMM gathers each assignment's
token row and multiplies it by its expert's gate/up weight; SiLU × up follows; the second
multiplies by the expert's down weight and scales by the routing weight; the top-k rows of each
token are then summed. As vLLM's ``fused_moe`` (without its tuned configs). Tested under
Triton's interpreter on the CPU against ``layers/moe/reference.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvfleet.engine.kernels.triton.fused_ops import silu_mul

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


class Aligned(NamedTuple):
    sorted_ids: torch.Tensor  # (blocks * BLOCK_M,) assignment index t*top_k+j, padding = T*top_k
    block_expert: torch.Tensor  # (blocks,) the expert of each block of BLOCK_M rows


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> Aligned:
    """Assignments sorted by expert, each expert's run padded to a multiple of ``block_m``."""
    flat = experts.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(padded, 0) - padded  # where each expert's run begins in the padded list
    first = torch.cumsum(counts, 0) - counts  # where it begins in the sorted list
    rank = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
    sorted_ids = torch.full((int(padded.sum()),), flat.numel(), dtype=torch.int64, device=flat.device)
    sorted_ids[starts[flat[order]] + rank] = order
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    return Aligned(sorted_ids, block_expert)


# Invariant: the BLOCK_M rows of program (m, n) all belong to expert block_expert[m]; a padding
# row (id >= num_valid) reads nothing and writes nothing.
@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    ids_ptr,
    expert_ptr,
    scale_ptr,
    num_valid,
    n,
    k,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    ROW_DIV: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ids = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_valid
    a_rows = ids // ROW_DIV
    expert = tl.load(expert_ptr + pid_m)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < k),
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
            mask=(cols[None, :] < n) & (ks[:, None] < k),
            other=0.0,
        )
        acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if SCALE:
        acc *= tl.load(scale_ptr + ids, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + ids[:, None] * stride_c + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < n))  # fmt: skip


def _gemm(
    a: torch.Tensor, w: torch.Tensor, aligned: Aligned, rows: int, row_div: int, scale: torch.Tensor | None
) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    c = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    grid = (aligned.block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, c, aligned.sorted_ids, aligned.block_expert, a if scale is None else scale,
        rows, n, k, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        ROW_DIV=row_div, SCALE=scale is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return c


def fused_moe(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The experts' weighted sum for each row of ``x`` (T, H): ``experts``/``weights`` (T, top_k)."""
    t, top_k = experts.shape
    if t == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    aligned = align_by_expert(experts, w13.shape[0])
    gate_up = _gemm(x, w13, aligned, t * top_k, top_k, None)
    h = silu_mul(gate_up).contiguous()
    scale = weights.reshape(-1).float().contiguous()
    down = _gemm(h, w2, aligned, t * top_k, 1, scale)
    return down.view(t, top_k, -1).sum(dim=1)
