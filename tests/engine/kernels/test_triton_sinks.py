"""The Triton paged-attention kernel with attention sinks (gpt-oss) against the torch reference:
decodes, a chunk on a cached prefix and a fresh prompt in one launch, with and without a window
(under ``TRITON_INTERPRET=1`` on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.attention import AttentionMetadata, LayerKV, get_backend
from kvfleet.engine.attention.torch_backend import paged_attention_reference


@pytest.mark.parametrize("window", [None, 3])
def test_the_triton_backend_with_sinks_equals_the_reference(window: int | None, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    k_cache = torch.randn(24, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(24, block, kv_heads, dim, generator=gen)
    seq_lens, query_lens = [9, 14, 6], [1, 5, 6]  # a decode, a chunk on 9 cached keys, a fresh prompt
    tables = torch.randperm(24, generator=gen)[:15].view(3, 5).to(torch.int32)
    starts = [0, 1, 6, 12]
    q = torch.randn(12, heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 3
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(12, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    want = paged_attention_reference(q, k_cache, v_cache, meta, dim**-0.5, window, sinks)
    on = AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(device),
        block_tables=tables.to(device),
        seq_lens=meta.seq_lens.to(device),
        query_start_loc=meta.query_start_loc.to(device),
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
    )
    layer = LayerKV(k_cache.to(device), v_cache.to(device), dim**-0.5, window, sinks.to(device))
    got = get_backend("triton").forward(q.to(device), layer, on)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    plain = paged_attention_reference(q, k_cache, v_cache, meta, dim**-0.5, window)
    assert not torch.allclose(got.cpu(), plain, atol=1e-3), "the sinks were meant to change the output"


def test_sinks_of_the_wrong_length_are_refused_naming_the_heads(device: torch.device) -> None:
    cache = torch.zeros(2, 4, 1, 16, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(1, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=1,
    )
    layer = LayerKV(cache, cache.clone(), 1.0, None, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match=r"sinks must be \(2,\), one per query head"):
        get_backend("triton").forward(torch.zeros(1, 2, 16, device=device), layer, meta)
