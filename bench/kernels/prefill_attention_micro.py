"""The native prefill attention kernel against the torch path it replaced, one layer at a time.

    python -m bench.kernels.prefill_attention_micro [--threads 2] [--lengths 128,256,512,1024]

Where it sits: beside ``engine/kernels/native/paged_prefill.py`` (the test of its numbers is
tests/engine/kernels/test_native_paged_prefill.py; this only times it). SmolLM2's attention geometry
(9 query heads over 3 KV heads of 64, 16-token blocks scattered in the pool). Per prompt
length, ms per layer and the causal GFLOP/s (4 x heads x head_dim x n^2 / 2) of:
``torch tiles``, the ``Fresh`` path of ``engine/attention/torch_batched.py`` (64-row query
tiles over the keys up to the tile, masked SDPA with ``enable_gqa``); ``torch one call``,
a single causal SDPA over the whole prompt; ``native``, the C kernel over the paged cache;
and ``native, cached half``, the second half of the prompt as a chunk behind the first
(the case the torch path padded and gathered).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfleet.engine.attention.base import AttentionMetadata, LayerKV
from kvfleet.engine.attention.torch_batched import BatchedAttention
from kvfleet.engine.kernels.native.paged_decode import PagedCache
from kvfleet.engine.kernels.native.paged_prefill import NativePrefill, load_prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def timed(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def step(n: int, rows: int) -> tuple[torch.Tensor, LayerKV, AttentionMetadata]:
    """One sequence of ``n`` tokens whose last ``rows`` are this step's, in a shuffled block pool."""
    blocks = -(-n // BLOCK)
    gen = torch.Generator().manual_seed(n)
    table = torch.randperm(blocks + 4, generator=gen)[:blocks].to(torch.int32)
    shape = (blocks + 4, BLOCK, KV_HEADS, HEAD_DIM)
    layer = LayerKV(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), HEAD_DIM**-0.5)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        block_tables=table[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
        max_query_len=rows,
        max_seq_len=n,
    )
    return torch.randn(rows, HEADS, HEAD_DIM, generator=gen), layer, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="128,256,512,1024")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernel = load_prefill()
    if kernel is None:
        raise SystemExit("the native library does not build here (no C compiler?)")
    print(f"# SmolLM2 attention ({HEADS} heads / {KV_HEADS} KV heads x {HEAD_DIM}), {args.threads} threads")
    print(f"{'prompt':>6} {'contender':24} {'ms/layer':>9} {'x30 ms':>8} {'causal GF/s':>12}")
    for n in (int(x) for x in args.lengths.split(",")):
        flops = 4 * HEADS * HEAD_DIM * n * n / 2
        for name, fn in contenders(n, kernel).items():
            ms = timed(fn, max(3, 4096 // n))
            f = flops * (0.75 if "half" in name else 1.0)  # the second half's rows see 3/4 of the square
            print(f"{n:6} {name:24} {ms:9.2f} {ms * 30:8.1f} {f / ms / 1e6:12.0f}", flush=True)


def contenders(n: int, kernel: NativePrefill) -> dict[str, Callable[[], object]]:
    """What is timed at prompt length ``n``: each a call over the same step's tensors."""
    q, layer, meta = step(n, n)
    torch_path = BatchedAttention(sdpa_decodes=False)
    table = meta.block_tables[0].long()
    ks = layer.k_cache[table].flatten(0, 1)[:n].transpose(0, 1)[None]
    vs = layer.v_cache[table].flatten(0, 1)[:n].transpose(0, 1)[None]
    qs = q.transpose(0, 1)[None]
    out = torch.empty_like(q)
    seqs = torch.tensor([0])
    paged = (layer.k_cache, layer.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    half_q, half_layer, half_meta = step(n, n // 2)
    half_paged = (half_layer.k_cache, half_layer.v_cache, half_meta.block_tables, half_meta.seq_lens,
                  half_meta.query_start_loc)  # fmt: skip
    half_out = torch.empty_like(half_q)
    return {
        "torch tiles": lambda: torch_path.forward(q, layer, meta, out=out),
        "torch one call": lambda: F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, enable_gqa=True, scale=layer.scale
        ),
        "native": lambda: kernel(q, PagedCache(*paged), seqs, out, layer.scale, None),
        "native, cached half": lambda: kernel(
            half_q, PagedCache(*half_paged), seqs, half_out, half_layer.scale, None
        ),
    }


if __name__ == "__main__":
    main()
