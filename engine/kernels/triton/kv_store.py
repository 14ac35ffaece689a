"""The KV store kernel: scatter one step's new keys and values into the paged cache.

Where it sits: every attention layer of the model runner calls
``TritonAttentionBackend.store_kv`` before ``forward``; this kernel is what it runs. The
runner's ``slot_mapping`` says where each new token lives (``block_id * block_size +
offset``); the scheduler's block pool guarantees the slots of one step are distinct.

On a machine without CUDA the kernels run under Triton's interpreter, which has to be
switched on (``TRITON_INTERPRET=1``) before this module is imported: ``INTERPRETED``
records which way the kernels were built.
"""

from __future__ import annotations

from typing import Final

import torch
import triton
import triton.language as tl

INTERPRETED: Final[bool] = bool(triton.knobs.runtime.interpret)

# Tokens written by one program: a (TOKENS, kv_heads * head_dim) tile.
_TOKENS_PER_PROGRAM: Final[int] = 16


# Invariant: token t's (kv_heads, head_dim) key and value rows land in cache slot
# slot_mapping[t], converted to the cache dtype; a slot outside [0, num_slots) writes nothing,
# so no token is ever written outside the cache.
@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    num_slots,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    TOKENS: tl.constexpr,
):
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    cols = tl.arange(0, ROW_PAD)
    head, dim = cols // HEAD_DIM, cols % HEAD_DIM
    token_ok = tokens < num_tokens
    slot = tl.load(slot_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)
    slot_ok = token_ok & (slot >= 0) & (slot < num_slots)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    mask = slot_ok[:, None] & (cols < ROW)[None, :]
    t64 = tokens.to(tl.int64)[:, None]
    src_k = t64 * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd
    src_v = t64 * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd
    dst = (
        (block * stride_cb + offset * stride_cs)[:, None]
        + head[None, :] * stride_ch
        + dim[None, :] * stride_cd
    )
    key = tl.load(k_ptr + src_k, mask=mask)
    value = tl.load(v_ptr + src_v, mask=mask)
    # narrowing rounds to nearest even on a GPU, as torch does (Triton 3.9's interpreter truncates)
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``, ``v`` (T, kv_heads, D) into ``k_cache``, ``v_cache`` at ``slot_mapping`` (T,)."""
    num_tokens, kv_heads, head_dim = k.shape
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    if num_tokens == 0:
        return
    row = kv_heads * head_dim
    grid = (triton.cdiv(num_tokens, _TOKENS_PER_PROGRAM),)
    _store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        num_blocks * block_size,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
        TOKENS=_TOKENS_PER_PROGRAM,
    )
