"""Flatten a scheduler plan into the one batch the model runs (docs/architecture.md §4, Runner).

Where it sits: inside ``ModelRunner.execute``, between the scheduler's plan (ids and
counts) and the model (tensors). No padding between sequences: the step's tokens lie
end to end, each with its own position and KV slot, and the attention metadata says
which rows belong to which sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import Sequence


def _token_at(seq: Sequence, pos: int) -> int:
    prompt = seq.prompt_token_ids
    return prompt[pos] if pos < len(prompt) else seq.output_token_ids[pos - len(prompt)]


@dataclass(frozen=True)
class FlatBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (N,) int64: the last row of each sequence that samples
    sample_seq_ids: tuple[int, ...]  # the seq_id of each of those rows, in order


@dataclass
class _Rows:
    """The batch's columns as Python lists, filled one scheduled sequence at a time."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=lambda: [0])
    sample_rows: list[int] = field(default_factory=list)
    sample_seq_ids: list[int] = field(default_factory=list)

    # Invariant: row r of the batch is token seq.all_token_ids[p] of its sequence, at position p,
    # stored in slot block_ids[p // block_size] * block_size + p % block_size.
    def add(self, entry: ScheduledSeq, block_size: int) -> None:
        seq, start, num_new, block_ids = entry
        end = start + num_new
        if len(block_ids) * block_size < end:
            raise ValueError(
                f"seq {seq.seq_id}: {len(block_ids)} blocks of {block_size} cannot hold {end} tokens"
            )
        if num_new == 1:  # a decode: the one token, without slicing the whole sequence
            self.input_ids.append(_token_at(seq, start))
            self.positions.append(start)
            self.slots.append(block_ids[start // block_size] * block_size + start % block_size)
        else:
            self.input_ids.extend(seq.tokens(start, end))
            self.positions.extend(range(start, end))
            self.slots.extend(
                block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)
            )
        self.seq_lens.append(end)
        rows = self.query_start[-1] + num_new
        self.query_start.append(rows)
        if end == len(seq.prompt_token_ids) + len(seq.output_token_ids):  # entry.sample, inlined
            self.sample_rows.append(rows - 1)
            self.sample_seq_ids.append(seq.seq_id)


def flatten_plan(plan: SchedulerPlan, block_size: int, device: torch.device) -> FlatBatch:
    rows = _Rows()
    for entry in plan.scheduled:
        rows.add(entry, block_size)
    width = max(len(s.block_ids) for s in plan.scheduled)
    tables = [list(s.block_ids) + [0] * (width - len(s.block_ids)) for s in plan.scheduled]

    def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(rows.slots, torch.int64),
        block_tables=tensor(tables, torch.int32),
        seq_lens=tensor(rows.seq_lens, torch.int32),
        query_start_loc=tensor(rows.query_start, torch.int32),
        max_query_len=max(s.num_new_tokens for s in plan.scheduled),
        max_seq_len=max(rows.seq_lens),
    )
    return FlatBatch(
        input_ids=tensor(rows.input_ids, torch.int64),
        positions=tensor(rows.positions, torch.int64),
        meta=meta,
        sample_rows=tensor(rows.sample_rows, torch.int64),
        sample_seq_ids=tuple(rows.sample_seq_ids),
    )
