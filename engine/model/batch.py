"""Flatten a scheduler plan into the one batch the model runs (docs/engine/steps-and-kernels.md).

Where it sits: between the scheduler's plan (ids and counts) and the model (tensors), as the
reference: the runner writes the same batch into its one set of persistent step buffers
(``engine/runner/step_buffers.py``, tested against :func:`flatten_plan`), benches and tests build it fresh
here. No padding between sequences: the step's tokens lie end to end, each with its own position
and KV slot, and the attention metadata says which rows belong to which sequence.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import Sequence as Seq


def _token_at(seq: Seq, pos: int) -> int:
    prompt = seq.prompt_token_ids
    return prompt[pos] if pos < len(prompt) else seq.output_token_ids[pos - len(prompt)]


@dataclass(frozen=True)
class FlatBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # (N,) int64: the last row of each sequence that samples
    sample_seq_ids: tuple[int, ...]  # the seq_id of each of those rows, in order


def _input_ids(scheduled: tuple[ScheduledSeq, ...]) -> list[int]:
    """The step's token ids, end to end (a decode's one token without slicing its sequence)."""
    ids: list[int] = []
    for seq, start, num_new, *_ in scheduled:
        if num_new == 1:
            ids.append(_token_at(seq, start))
        else:
            ids.extend(seq.tokens(start, start + num_new))
    return ids


def _block_tables(rows: Iterable[Sequence[int]], lens: np.ndarray) -> np.ndarray:
    """(rows, widest) int32, each row its sequence's block ids then zeros."""
    tables = np.zeros((len(lens), int(lens.max())), dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, int(lens.sum()))
    tables[np.arange(tables.shape[1]) < lens[:, None]] = flat
    return tables


# Invariant: every group's table has the same length as group 0's (freed blocks keep their place), so
# row r's slot in group g is tables_g[seq, p // block_size] * block_size + p % block_size.
def group_tables(
    scheduled: Sequence[ScheduledSeq], lens: np.ndarray, row_seq: np.ndarray, positions: np.ndarray,
    block_size: int, device: torch.device,
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:  # fmt: skip
    """KV cache groups 1..'s (slot_mapping, block_tables) for the step (``AttentionMetadata.kv_groups``)."""
    out = []
    for g in range(len(scheduled[0].group_block_ids) if scheduled else 0):
        tables = _block_tables((e.group_block_ids[g] for e in scheduled), lens)
        slots = (
            tables[row_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
        )
        out.append((torch.from_numpy(slots).to(device), torch.from_numpy(tables).to(device)))
    return tuple(out)


# Invariant: row r of the batch is token seq.all_token_ids[p] of its sequence, at position p,
# stored in slot block_ids[p // block_size] * block_size + p % block_size; a sequence samples
# (its last row is a sample row) when its chunk reaches the end of its known tokens.
def flatten_plan(plan: SchedulerPlan, block_size: int, device: torch.device) -> FlatBatch:
    scheduled = plan.scheduled
    n = len(scheduled)
    start = np.fromiter((e.num_computed_before for e in scheduled), np.int64, n)
    num_new = np.fromiter((e.num_new_tokens for e in scheduled), np.int64, n)
    lens = np.fromiter((len(e.block_ids) for e in scheduled), np.int64, n)
    end = start + num_new
    short = np.flatnonzero(lens * block_size < end)
    if short.size:
        r = int(short[0])
        raise ValueError(
            f"seq {scheduled[r].seq.seq_id}: {lens[r]} blocks of {block_size} cannot hold {end[r]} tokens"
        )
    tables = _block_tables((e.block_ids for e in scheduled), lens)
    query_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start[1:])
    row_seq = np.repeat(np.arange(n), num_new)  # each row's sequence
    positions = np.arange(query_start[-1]) - query_start[row_seq] + start[row_seq]
    slots = tables[row_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    samples = np.fromiter((e.seq.num_tokens for e in scheduled), np.int64, n) == end
    sample_seq_ids = tuple(e.seq.seq_id for e, s in zip(scheduled, samples.tolist(), strict=True) if s)

    def tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(values).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64),
        block_tables=tensor(tables, torch.int32),
        seq_lens=tensor(end, torch.int32),
        query_start_loc=tensor(query_start, torch.int32),
        max_query_len=int(num_new.max()),
        max_seq_len=int(end.max()),
        kv_groups=group_tables(scheduled, lens, row_seq, positions, block_size, device),
    )
    return FlatBatch(
        input_ids=torch.tensor(_input_ids(scheduled), dtype=torch.int64, device=device),
        positions=tensor(positions, torch.int64),
        meta=meta,
        sample_rows=tensor(query_start[1:][samples] - 1, torch.int64),
        sample_seq_ids=sample_seq_ids,
    )
