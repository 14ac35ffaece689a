"""The paged-attention kernel: one launch for a whole mixed prefill / chunked-prefill / decode step.

Where it sits: ``TritonAttentionBackend.forward`` runs it once per attention layer per step,
after ``store_kv`` has put the step's new keys and values in the cache. The shapes and the
causality contract are those of ``kvfleet.engine.attention.base``; the torch reference
``paged_attention_reference`` is its oracle in the tests.

Work split: the grid is (query tile, kv head). Sequence ``s`` owns the tiles from
``query_start_loc[s] // BLOCK_Q + s`` on (an upper bound that needs no host sync), and a
program finds its sequence by binary search over ``query_start_loc``. A program holds the
``BLOCK_Q`` query tokens of its tile times the ``GROUP`` query heads that share its kv head
as the rows of one tile, so every KV block is loaded once per kv-head group (GQA).

Sliding window (``HAS_WINDOW``): a program starts its key loop at the first key tile its
earliest query row can see (``position - window + 1``), so a long sequence's decode reads
only about ``window`` keys, and masks the keys before each row's own window start.

Attention sinks (``HAS_SINKS``, gpt-oss): each row's online softmax starts from its head's sink
logit instead of from nothing (m = sink in the log2 domain, l = 1, acc = 0), so the sink joins the
softmax's sum and adds no value.
"""

from __future__ import annotations

from typing import Final, NamedTuple

import torch
import triton
import triton.language as tl

INTERPRETED: Final[bool] = bool(triton.knobs.runtime.interpret)
# Triton 3.9's interpreter misreads bf16 operands of tl.dot; under it bf16 tiles are widened to
# fp32 before each dot (DOT_FP32), so CPU tests still cover bf16 loads, conversions and stores.

_LOG2_E: Final[float] = 1.4426950408889634
_MIN_DOT: Final[int] = 16  # tl.dot on GPUs needs every dimension >= 16


# Invariant: returns the last sequence s with query_start[s] // BLOCK_Q + s <= tile, i.e. the
# sequence whose tile range holds ``tile``; these starts are non-decreasing in s.
@triton.jit
def _find_sequence(query_start_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The keys query tile ``q_tile`` of a sequence may see, as [kv_start, kv_end): up to its last
# row's position (causal), and from the key tile holding its first row's window start
# (kv_start a multiple of TILE_N; 0 without a window). Rows mask the keys before their own start.
@triton.jit
def _key_range(
    seq_len, q_len, q_tile, window, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    kv_end = tl.minimum(seq_len, seq_len - q_len + (q_tile + 1) * BLOCK_Q)
    if HAS_WINDOW:
        first = seq_len - q_len + q_tile * BLOCK_Q - window + 1
        kv_start = tl.maximum(first, 0) // TILE_N * TILE_N
    else:
        kv_start = 0
    return kv_start, kv_end


# Invariant: after the loop over key tiles [0, n), for each row r (query token, head) m_r is
# the running max of its scaled scores (log2 domain), l_r = sum exp2(score - m_r) and
# acc_r = sum exp2(score - m_r) * v over the keys seen that row r may attend (key <= its
# position seq_len - query_len + i, and key > position - window with a window); out = acc / l
# once every key of the row's range is seen. Tiles before kv_start hold no key any row may see.
@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    sinks_ptr,
    num_seqs,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq = _find_sequence(query_start_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, DIM_PAD)
        io_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
        token = (q_start + q_idx).to(tl.int64)
        q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
        q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
        position = seq_len - q_len + q_idx
        kv_start, kv_end = _key_range(seq_len, q_len, q_tile, window, BLOCK_Q, TILE_N, HAS_WINDOW)
        m_0, l_0 = _softmax_start(sinks_ptr, head, row_ok, BLOCK_Q * GROUP_PAD, HAS_SINKS)
        acc, l_i = _attend_blocks(
            q,
            m_0,
            l_0,
            position,
            kv_start,
            kv_end,
            window,
            k_cache_ptr + kv_head * stride_ch,
            v_cache_ptr + kv_head * stride_ch,
            block_tables_ptr + seq.to(tl.int64) * stride_bt,
            stride_cb,
            stride_cs,
            stride_cd,
            scale_log2,
            HEAD_DIM,
            DIM_PAD,
            BLOCK_SIZE,
            TILE_N,
            PRECISION,
            DOT_FP32,
            HAS_WINDOW,
        )
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


# Each row's running max and sum before its first key: nothing (-inf as -1e30, 0), or with sinks
# its head's sink as the softmax's first logit (m = sink in the log2 domain, l = exp2(0) = 1).
@triton.jit
def _softmax_start(sinks_ptr, head, row_ok, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    if HAS_SINKS:
        m_0 = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_0 = tl.full([ROWS], 1.0, tl.float32)
    else:
        m_0 = tl.full([ROWS], -1.0e30, tl.float32)
        l_0 = tl.zeros([ROWS], tl.float32)
    return m_0, l_0


@triton.jit
def _attend_blocks(
    q,
    m_i,
    l_i,
    position,
    kv_start,
    kv_end,
    window,
    k_base,
    v_base,
    table_ptr,
    stride_cb,
    stride_cs,
    stride_cd,
    scale_log2,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    ROWS: tl.constexpr = q.shape[0]
    if DOT_FP32:
        q = q.to(tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    dims = tl.arange(0, DIM_PAD)
    for n0 in range(kv_start, kv_end, TILE_N):
        keys = n0 + tl.arange(0, TILE_N)
        key_ok = keys < kv_end
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (keys % BLOCK_SIZE) * stride_cs
        kv_off = slot[:, None] + dims[None, :] * stride_cd
        kv_mask = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = key_ok[None, :] & (keys[None, :] <= position[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > position[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i


class TileConfig(NamedTuple):
    block_q: int
    group_pad: int
    dim_pad: int
    tile_n: int
    num_warps: int


def choose_tiles(group: int, head_dim: int, max_query_len: int) -> TileConfig:
    """Tile sizes. Decode steps (every query one token) take the fewest rows a GPU dot allows and
    longer key tiles, since they are bound by reading the cache; prefill takes more query rows."""
    group_pad = triton.next_power_of_2(group)
    dim_pad = max(triton.next_power_of_2(head_dim), _MIN_DOT)
    target_rows = _MIN_DOT if max_query_len <= 1 else (32 if dim_pad > 128 else 64)
    block_q = max(target_rows // group_pad, 1)
    tile_n = 16 if dim_pad > 128 else (64 if max_query_len <= 1 else 32)
    num_warps = 8 if block_q * group_pad * dim_pad > 64 * 128 else 4
    return TileConfig(block_q, group_pad, dim_pad, tile_n, num_warps)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` (T, H, D) over the paged cache, each row over the last
    ``sliding_window`` keys up to its position when given (with ``sinks``, (H,): each head's logit
    in its softmax); returns (T, H, D) in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = int(seq_lens.shape[0])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = choose_tiles(group, head_dim, max_query_len)
    grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        q if sinks is None else sinks,  # not read without sinks
        num_seqs,
        scale * _LOG2_E,
        sliding_window or 0,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=cfg.group_pad,
        HEAD_DIM=head_dim,
        DIM_PAD=cfg.dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=cfg.block_q,
        TILE_N=cfg.tile_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16,
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps,
    )
    return out
