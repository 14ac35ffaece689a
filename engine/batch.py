"""Flatten a scheduler plan into the one batch the model runs (DESIGN.md §4, Runner).

Where it sits: inside ``ModelRunner.execute``, between the scheduler's plan (ids and
counts) and the model (tensors). No padding between sequences: the step's tokens lie
end to end, each with its own position and KV slot, and the attention metadata says
which rows belong to which sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.sched.plan import SchedulerPlan


@dataclass(frozen=True)
class FlatBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (N,) int64: the last row of each sequence that samples
    sample_seq_ids: tuple[int, ...]  # the seq_id of each of those rows, in order


def flatten_plan(plan: SchedulerPlan, block_size: int, device: torch.device) -> FlatBatch:
    # Invariant: row r of the batch is token seq.all_token_ids[p] of its sequence, at position p,
    # stored in slot block_ids[p // block_size] * block_size + p % block_size.
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start = [0]
    sample_rows: list[int] = []
    sample_seq_ids: list[int] = []
    for s in plan.scheduled:
        start, end = s.num_computed_before, s.context_len
        if len(s.block_ids) * block_size < end:
            raise ValueError(
                f"seq {s.seq.seq_id}: {len(s.block_ids)} blocks of {block_size} cannot hold {end} tokens"
            )
        input_ids.extend(s.token_ids)
        positions.extend(range(start, end))
        slots.extend(s.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
        seq_lens.append(end)
        query_start.append(query_start[-1] + s.num_new_tokens)
        if s.sample:
            sample_rows.append(query_start[-1] - 1)
            sample_seq_ids.append(s.seq.seq_id)
    width = max(len(s.block_ids) for s in plan.scheduled)
    tables = [list(s.block_ids) + [0] * (width - len(s.block_ids)) for s in plan.scheduled]

    def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64),
        block_tables=tensor(tables, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        query_start_loc=tensor(query_start, torch.int32),
        max_query_len=max(s.num_new_tokens for s in plan.scheduled),
        max_seq_len=max(seq_lens),
    )
    return FlatBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        meta=meta,
        sample_rows=tensor(sample_rows, torch.int64),
        sample_seq_ids=tuple(sample_seq_ids),
    )
