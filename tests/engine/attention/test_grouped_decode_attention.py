"""The torch backend's batched decode path gives the per-sequence reference's result."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.attention import LayerKV, get_backend
from kvfleet.engine.attention.torch_backend import paged_attention_reference

from .steps import step_metadata


@pytest.mark.parametrize("window", [None, 1, 3, 6])
def test_decoding_sequences_batched_together_match_the_per_sequence_reference(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 8, 2, 16, 4
    k_cache = torch.randn(20, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(20, block, kv_heads, dim, generator=gen)
    # two prefills (5 and 3 new rows) among three decodes of ragged context lengths
    seq_lens, query_lens = [9, 1, 14, 5, 3], [1, 1, 5, 1, 3]
    tables = torch.tensor(
        [[3, 7, 1, 0], [9, 0, 0, 0], [2, 4, 6, 8], [11, 12, 0, 0], [15, 0, 0, 0]], dtype=torch.int32
    )
    meta = step_metadata(seq_lens, query_lens, tables)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    ours = get_backend("torch").forward(q, LayerKV(k_cache, v_cache, dim**-0.5, window), meta)
    torch.testing.assert_close(ours, paged_attention_reference(q, k_cache, v_cache, meta, dim**-0.5, window))
    # K and V in one (2, blocks, ...) tensor, as the runner allocates them: one gather, the same bits.
    kv = torch.stack((k_cache, v_cache))
    assert torch.equal(get_backend("torch").forward(q, LayerKV(kv[0], kv[1], dim**-0.5, window), meta), ours)


def test_many_ragged_decodes_and_prefill_chunks_split_into_buckets_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block = 8, 2, 16, 4
    k_cache = torch.randn(400, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(400, block, kv_heads, dim, generator=gen)
    # 20 decodes (two length buckets) and 6 prefill chunks of ragged query lengths (one padded call)
    query_lens = [1] * 20 + [7, 2, 13, 4, 9, 3]
    seq_lens = [3 + 5 * i for i in range(20)] + [7, 10, 30, 4, 9, 21]
    order = [20, 0, 5, 21, 1, 2, 22, 3, 4, 6, 7, 23, 8, 9, 10, 11, 24, 12, 13, 14, 15, 16, 25, 17, 18, 19]
    query_lens = [query_lens[i] for i in order]
    seq_lens = [seq_lens[i] for i in order]
    width = max(-(-n // block) for n in seq_lens)
    perm = torch.randperm(399, generator=gen) + 1
    tables, used = [], 0
    for n in seq_lens:
        need = -(-n // block)
        tables.append(perm[used : used + need].tolist() + [0] * (width - need))
        used += need
    meta = step_metadata(seq_lens, query_lens, torch.tensor(tables, dtype=torch.int32))
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    backend = get_backend("torch")
    ours = backend.forward(q, LayerKV(k_cache, v_cache, dim**-0.5), meta)
    torch.testing.assert_close(ours, paged_attention_reference(q, k_cache, v_cache, meta, dim**-0.5))
    # the next layer of the same step reuses the step's grouping, with another cache and a window
    k2, v2 = k_cache.flip(0), v_cache.flip(0)
    again = backend.forward(q, LayerKV(k2, v2, dim**-0.5, 5), meta)
    torch.testing.assert_close(again, paged_attention_reference(q, k2, v2, meta, dim**-0.5, 5))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 2, 90])
def test_prompts_from_their_first_token_are_attended_in_tiles_and_match_the_reference(
    backend: str, window: int | None
) -> None:
    from kvfleet.engine.attention.torch_batched import FRESH_TILE, BatchedAttention, plan_step

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block = 6, 2, 16, 16
    k_cache = torch.randn(40, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(40, block, kv_heads, dim, generator=gen)
    # fresh prompts of 7 and 150 rows (3 tiles), a chunk of 6 rows on 20 cached ones, a decode
    seq_lens, query_lens = [7, 150, 26, 5], [7, 150, 6, 1]
    perm = torch.randperm(40, generator=gen).tolist()
    tables = torch.tensor([perm[0:10], perm[10:20], perm[20:30], perm[30:40]], dtype=torch.int32)
    meta = step_metadata(seq_lens, query_lens, tables)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    layout = plan_step(meta, BatchedAttention.geometry(q, k_cache), sdpa_decodes=False)
    assert [(f.first_row, f.num_rows) for f in layout.fresh] == [(0, 7), (7, 150)]
    assert layout.fresh[1].tiles() == [(0, FRESH_TILE), (FRESH_TILE, 2 * FRESH_TILE), (2 * FRESH_TILE, 150)]
    assert layout.fresh[1].key_slots[:3].tolist() == [perm[10] * block + i for i in range(3)]
    assert layout.fresh[1].key_slots[16].item() == perm[11] * block
    assert [g.num_seqs for g in layout.groups] == [1]  # the chunk on cached context: as before
    ours = get_backend(backend).forward(q, LayerKV(k_cache, v_cache, dim**-0.5, window), meta)
    torch.testing.assert_close(ours, paged_attention_reference(q, k_cache, v_cache, meta, dim**-0.5, window))
