"""The torch backend's batched decode path gives the per-sequence reference's result."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.attention import AttentionMetadata, get_backend
from kvfleet.engine.attention.torch_backend import paged_attention_reference


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
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=5,
        max_seq_len=14,
    )
    q = torch.randn(starts[-1], heads, dim, generator=gen)
    ours = get_backend("torch").forward(q, k_cache, v_cache, meta, dim**-0.5, window)
    torch.testing.assert_close(ours, paged_attention_reference(q, k_cache, v_cache, meta, dim**-0.5, window))
