"""One step's ``AttentionMetadata`` from its sequence lengths, as the attention tests build their steps."""

from __future__ import annotations

import torch

from kvfleet.engine.attention import AttentionMetadata


def step_metadata(seq_lens: list[int], query_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    """One step's metadata: each sequence's last ``query_lens`` rows new, of ``seq_lens`` in all."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
