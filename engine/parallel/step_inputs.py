"""A step's inputs, from rank 0 to every worker: a small header, then one broadcast tensor.

Where it sits: rank 0's runner flattens the scheduler's plan once (``engine/model/batch.py``) and
:func:`pack` turns the batch (input ids, positions, the attention metadata's tensors, the rows
that sample, each row's LoRA slot, the slot mapping and block tables of KV cache groups 1..) into a :class:`StepHeader` of sizes and one int64 tensor.
The header travels on the worker's control link (``parallel/leader.py``), the tensor by one
``dist.broadcast``; a worker rebuilds the same batch with :func:`unpack`. The scheduler and the
plan never leave rank 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.model.batch import FlatBatch


class StepHeader(NamedTuple):
    rows: int  # T: the step's tokens
    seqs: int  # S
    table_width: int  # the block tables' columns
    samples: int  # N: rows that sample
    max_query_len: int
    max_seq_len: int
    lora: dict[str, int] | None  # adapter name → device slot, when the step has adapter rows
    kv_groups: int = 0  # KV cache groups beyond the first (engine/kv/groups.py)

    @property
    def numel(self) -> int:
        t, s = self.rows, self.seqs
        groups = self.kv_groups * (t + s * self.table_width)
        return (
            3 * t
            + s * self.table_width
            + s
            + (s + 1)
            + self.samples
            + (t if self.lora is not None else 0)
            + groups
        )


class WorkerStep(NamedTuple):
    """What a worker's forward reads: the batch, and each row's adapter slot (None: no adapters)."""

    batch: FlatBatch
    token_slots: list[int] | None


def pack(
    batch: FlatBatch, lora: dict[str, int] | None, token_slots: torch.Tensor | None
) -> tuple[StepHeader, torch.Tensor]:
    meta = batch.meta
    seqs, width = meta.block_tables.shape
    header = StepHeader(
        int(batch.input_ids.shape[0]),
        int(seqs),
        int(width),
        int(batch.sample_rows.shape[0]),
        meta.max_query_len,
        meta.max_seq_len,
        lora,
        len(meta.kv_groups),
    )
    parts = [
        batch.input_ids,
        batch.positions,
        meta.slot_mapping,
        meta.block_tables.flatten(),
        meta.seq_lens,
        meta.query_start_loc,
        batch.sample_rows,
    ]
    if lora is not None:
        assert token_slots is not None
        parts.append(token_slots)
    for slot_mapping, block_tables in meta.kv_groups:
        parts += [slot_mapping, block_tables.flatten()]
    flat = torch.cat([p.to(torch.int64) for p in parts])
    assert flat.numel() == header.numel
    return header, flat


def unpack(header: StepHeader, flat: torch.Tensor) -> WorkerStep:
    t, s, n = header.rows, header.seqs, header.samples
    sizes = [t, t, t, s * header.table_width, s, s + 1, n] + ([t] if header.lora is not None else [])
    sizes += [t, s * header.table_width] * header.kv_groups
    parts = list(torch.split(flat, sizes))
    i32 = torch.int32
    rest = parts[len(sizes) - 2 * header.kv_groups :]
    groups = tuple(
        (rest[2 * g], rest[2 * g + 1].view(s, header.table_width).to(i32)) for g in range(header.kv_groups)
    )
    meta = AttentionMetadata(
        slot_mapping=parts[2],
        block_tables=parts[3].view(s, header.table_width).to(i32),
        seq_lens=parts[4].to(i32),
        query_start_loc=parts[5].to(i32),
        max_query_len=header.max_query_len,
        max_seq_len=header.max_seq_len,
        kv_groups=groups,
    )
    batch = FlatBatch(parts[0], parts[1], meta, parts[6], ())
    slots = [int(v) for v in parts[7].tolist()] if header.lora is not None else None
    return WorkerStep(batch, slots)
