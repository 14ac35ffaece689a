"""The native CPU prefill attention kernel against the torch reference, and the ``cpu`` backend's use of it.

The paged batches hold NaN in every slot no sequence owns, so a kernel that read one key past a
row's own position, or another sequence's block, would give NaN rows, not a small error.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet.engine.attention import LayerKV, get_backend
from kvfleet.engine.attention.cpu_backend import split_rows
from kvfleet.engine.attention.torch_backend import paged_attention_reference
from kvfleet.engine.kernels.native.paged_decode import PagedCache
from kvfleet.engine.kernels.native.paged_prefill import NativePrefill, load_prefill, prefill_ok

from .conftest import PagedBatch, make_paged_batch, needs_compiler

# (seq_len, query_len): whole prompts (one shorter than a tile, one of several tiles with a
# ragged last one), chunks behind a cached prefix (across block boundaries), and a decode row
PROMPTS = [(5, 5), (70, 70), (100, 37), (48, 16), (33, 1), (131, 2)]

GEOMETRIES = [
    (2, 2, 64, 16),  # MHA
    (9, 3, 64, 16),  # SmolLM2: 3 query heads per KV head
    (8, 1, 32, 16),  # GQA 8, the tiny model's head size
    (4, 2, 128, 8),  # Llama's head size, small blocks
    (16, 1, 16, 32),  # 16 query heads per KV head, the most the kernel takes
    (6, 3, 80, 16),  # a head size that is not a multiple of 64
    (2, 1, 256, 4),  # the largest head size it takes
]


def _prefill(batch: PagedBatch, scale: float, window: int | None) -> torch.Tensor:
    kernel = load_prefill()
    assert kernel is not None
    seqs = split_rows(batch.meta.query_start_loc).prefills
    assert seqs is not None
    out = torch.full_like(batch.q, 7.0)  # rows the kernel does not own keep this
    meta = batch.meta
    paged = PagedCache(batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    kernel(batch.q, paged, seqs, out, scale, window)
    return out


def _prefill_rows(batch: PagedBatch) -> torch.Tensor:
    starts = batch.meta.query_start_loc.tolist()
    rows = [range(a, b) for a, b in zip(starts, starts[1:], strict=False) if b - a > 1]
    return torch.tensor([r for span in rows for r in span])


@needs_compiler
@pytest.mark.parametrize("window", [None, 7, 40], ids=["causal", "window-7", "window-40"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), GEOMETRIES)
def test_prefill_kernel_matches_the_reference_on_every_prompt_row(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, window: int | None, threads: int
) -> None:
    batch = make_paged_batch(
        PROMPTS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size
    )
    scale = 1 / math.sqrt(head_dim)
    got = _prefill(batch, scale, window)
    want = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window)
    rows = _prefill_rows(batch)
    torch.testing.assert_close(got[rows], want[rows], atol=2e-5, rtol=1e-4)


@needs_compiler
def test_prefill_kernel_writes_only_the_rows_of_the_sequences_it_is_given() -> None:
    batch = make_paged_batch(PROMPTS, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    got = _prefill(batch, 0.2, None)
    starts = batch.meta.query_start_loc.tolist()
    decode_row = starts[4]  # (33, 1): one row, not a prefill
    assert torch.equal(got[decode_row], torch.full_like(got[decode_row], 7.0))
    assert torch.isfinite(got[_prefill_rows(batch)]).all()


@needs_compiler
def test_a_long_prompt_in_one_call_matches_the_reference_across_many_key_blocks() -> None:
    # 300 rows: the key walk crosses four 64-key blocks, with the running max rescaling the sums
    batch = make_paged_batch(
        [(300, 300), (260, 190)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16
    )
    batch.q.mul_(4.0)  # sharper softmax: the online max matters
    got = _prefill(batch, 0.125, None)
    want = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, None)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_prefill_ok_names_the_geometries_the_kernel_takes() -> None:
    assert prefill_ok(9, 3, 64)
    assert prefill_ok(32, 8, 128)
    assert prefill_ok(16, 1, 256)
    assert not prefill_ok(4, 2, 24)  # not a multiple of 16
    assert not prefill_ok(4, 2, 272)  # above 256
    assert not prefill_ok(17, 1, 64)  # 17 query heads per KV head
    assert not prefill_ok(6, 4, 64)  # heads not a multiple of KV heads


@needs_compiler
def test_the_kernel_refuses_a_head_size_it_does_not_take_with_a_clear_error() -> None:
    kernel = load_prefill()
    assert isinstance(kernel, NativePrefill)
    batch = make_paged_batch([(20, 20)], num_heads=2, num_kv_heads=1, head_dim=24, block_size=16)
    meta = batch.meta
    with pytest.raises(ValueError, match="does not take 2 heads over 1 KV heads of size 24"):
        paged = PagedCache(
            batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc
        )
        kernel(batch.q, paged, torch.tensor([0]), torch.empty_like(batch.q), 0.2, None)


@needs_compiler
@pytest.mark.parametrize("head_dim", [32, 24], ids=["native-prefill", "torch-prefill"])
def test_the_cpu_backend_matches_the_reference_with_or_without_the_prefill_kernel(head_dim: int) -> None:
    # head size 24: the prefill chunks fall back to the batched SDPA path, the decodes stay native
    batch = make_paged_batch(PROMPTS, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16)
    scale = 1 / math.sqrt(head_dim)
    got = get_backend("cpu").forward(batch.q, LayerKV(batch.k_cache, batch.v_cache, scale, None), batch.meta)
    want = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, None)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_split_rows_sorts_a_step_into_decodes_and_prefill_chunks() -> None:
    split = split_rows(torch.tensor([0, 5, 6, 7, 40], dtype=torch.int32))
    assert split.decodes is not None and split.decodes.tolist() == [1, 2]
    assert split.prefills is not None and split.prefills.tolist() == [0, 3]
    only_decodes = split_rows(torch.tensor([0, 1, 2], dtype=torch.int32))
    assert only_decodes.prefills is None and only_decodes.decodes is not None


@needs_compiler
def test_the_cpu_backend_uses_the_prefill_kernel_only_where_it_is_the_faster_build() -> None:
    kernel = load_prefill()
    assert kernel is not None
    backend = get_backend("cpu")
    assert (backend._native_prefill is kernel) == kernel.preferred  # noqa: SLF001
    flags = _cpu_flags().split()
    assert kernel.preferred == ("avx512f" in flags or "avx2" in flags)


def _cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line for line in f if line.startswith("flags")), "")
