"""Static step buffers: a decode step's inputs in preallocated tensors, filled by one host-to-device copy.

Where it sits: between the scheduler's plan and the model, beside :func:`kvfleet.engine.batch.flatten_plan`
(which builds fresh tensors for any step). :class:`StepBuffers` serves the decode steps (one new
token per sequence, every sequence sampling) of :mod:`kvfleet.engine.decode_path`: the values of the
columns ``flatten_plan`` builds (token ids, positions, KV slots, block tables, sequence lengths, query
start locations, sample rows) are written into one pinned host buffer (pinned on CUDA only), copied
to the device in one copy, and read through views of fixed addresses, which is what a CUDA graph
replays against. Nothing is allocated on the device per step.

Layout of the one byte buffer, by region (``S`` = ``max_seqs`` rows, ``W`` = ``max_blocks`` per row):
int64 ``input_ids[S]``, ``positions[S]``, ``slot_mapping[S]``, ``sample_rows[S]``, ``feed_rows[S]``, then int32
``seq_lens[S]``, ``query_start_loc[S + 1]``, ``block_tables[S, W]``. The regions sit at fixed offsets
whatever the batch, and a step copies the prefix up to its last block-table row. ``sample_rows``
and ``query_start_loc`` are ``arange`` for every decode batch: written once, at construction.

Async scheduling (``engine/async_scheduling.py``): a row whose token is not known on the host yet
(``PLACEHOLDER_TOKEN``, sampled by the step still on the device) names in ``feed_rows`` the row of the
previous step's token buffer that holds it, and :meth:`StepBuffers.feed` copies those tokens into
``input_ids`` on the device after the copy (no host round trip); other rows hold -1 there.

Padding rows (a batch padded up to a captured size, :mod:`kvfleet.engine.cuda_graphs`) decode token
0 at position 0 into ``null_slot`` (a KV slot no sequence owns) with a sequence length of 1 and a
block table of ``null_block``: they read and write only that slot, and nobody samples them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.batch import FlatBatch
from kvfleet.engine.sched.plan import ScheduledSeq
from kvfleet.engine.sequence import PLACEHOLDER_TOKEN


class FedTokens(Protocol):
    """The previous step's sampled tokens, still on the device (async scheduling)."""

    @property
    def tokens(self) -> torch.Tensor:
        """(rows,) int64 on the device."""
        ...

    @property
    def rows_of(self) -> Mapping[int, int]:
        """seq id → its row in ``tokens``."""
        ...


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of the regions in the buffer."""

    max_seqs: int
    max_blocks: int

    @property
    def int32_start(self) -> int:
        return 5 * self.max_seqs * 8

    @property
    def tables_start(self) -> int:
        return self.int32_start + (2 * self.max_seqs + 1) * 4

    def end(self, rows: int) -> int:
        """The bytes a step of ``rows`` rows reads: everything up to its last block-table row."""
        return self.tables_start + rows * self.max_blocks * 4

    @property
    def nbytes(self) -> int:
        return self.end(self.max_seqs)


class _Views:
    """The regions of one byte buffer as typed tensors (full size)."""

    def __init__(self, buf: torch.Tensor, layout: _Layout) -> None:
        s, w = layout.max_seqs, layout.max_blocks
        i64 = buf[: layout.int32_start].view(torch.int64)
        i32 = buf[layout.int32_start : layout.nbytes].view(torch.int32)
        self.input_ids, self.positions = i64[:s], i64[s : 2 * s]
        self.slot_mapping, self.sample_rows = i64[2 * s : 3 * s], i64[3 * s : 4 * s]
        self.feed_rows = i64[4 * s :]
        self.seq_lens, self.query_start_loc = i32[:s], i32[s : 2 * s + 1]
        self.block_tables = i32[2 * s + 1 :].view(s, w)


class StepBuffers:
    """Decode-step inputs for up to ``max_seqs`` rows of up to ``max_blocks`` KV blocks each."""

    def __init__(
        self, max_seqs: int, max_blocks: int, block_size: int, null_block: int, device: torch.device
    ) -> None:
        self.layout = _Layout(max_seqs, max_blocks)
        self.block_size, self.device = block_size, device
        self.null_block = null_block
        pin = device.type == "cuda"
        self._host = torch.zeros(self.layout.nbytes, dtype=torch.uint8, pin_memory=pin)
        self._device = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        self.host, self.dev = _Views(self._host, self.layout), _Views(self._device, self.layout)
        self._np = {name: getattr(self.host, name).numpy() for name in vars(self.host)}
        self._np["sample_rows"][:] = np.arange(max_seqs)
        self._np["query_start_loc"][:] = np.arange(max_seqs + 1)
        self._np["block_tables"][:] = null_block
        # Every row is padding until a step fills it: a warm-up or capture before the first step
        # writes only the null slot.
        self._np["slot_mapping"][:] = self.null_slot
        self._np["seq_lens"][:] = 1
        self._rows = np.arange(max_seqs)
        self._tables: list[tuple[int, ...] | None] = [None] * max_seqs
        # The last copy, on CUDA: the host buffer is busy until it ends.
        self._copied: torch.cuda.Event | None = None
        self._copy(max_seqs)

    @property
    def null_slot(self) -> int:
        return self.null_block * self.block_size

    def fits(self, scheduled: Sequence[ScheduledSeq]) -> bool:
        return len(scheduled) <= self.layout.max_seqs and all(
            len(s.block_ids) <= self.layout.max_blocks for s in scheduled
        )

    # Invariant: after fill(scheduled, rows), device row r < len(scheduled) holds exactly what
    # flatten_plan would put in row r for this decode step, and rows len(scheduled)..rows-1 are padding;
    # self._tables[r] is the block table host row r holds (None: unknown), so an unchanged one is not rewritten.
    def fill(self, scheduled: Sequence[ScheduledSeq], rows: int, fed: FedTokens | None = None) -> None:
        """Write a decode step (every entry one new token, sampled) padded to ``rows`` rows, and copy it;
        placeholder tokens are taken from ``fed``, the previous step's tokens, on the device."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy may still read the host buffer
        n, bs, a = len(scheduled), self.block_size, self._np
        ids, pos = [], []
        tables, known = a["block_tables"], self._tables
        for r, (seq, start, _, block_ids) in enumerate(scheduled):
            prompt = seq.prompt_token_ids
            ids.append(prompt[start] if start < len(prompt) else seq.output_token_ids[start - len(prompt)])
            pos.append(start)
            if known[r] != block_ids:  # a new sequence in this row, or a new block: rewrite it
                tables[r, : len(block_ids)] = block_ids
                known[r] = block_ids
        a["input_ids"][:n], a["positions"][:n] = ids, pos
        feeds = PLACEHOLDER_TOKEN in ids
        if feeds:
            assert fed is not None, "a placeholder token without the step that samples it"
            rows_of = fed.rows_of
            a["feed_rows"][:n] = [
                rows_of[s.seq.seq_id] if t < 0 else -1 for s, t in zip(scheduled, ids, strict=True)
            ]
            a["feed_rows"][n:rows] = -1
        p = a["positions"][:n]
        a["slot_mapping"][:n] = tables[self._rows[:n], p // bs] * bs + p % bs
        np.add(p, 1, out=a["seq_lens"][:n], casting="unsafe")
        a["input_ids"][n:rows], a["positions"][n:rows], a["slot_mapping"][n:rows] = 0, 0, self.null_slot
        a["seq_lens"][n:rows] = 1
        tables[n:rows, 0] = self.null_block
        known[n:rows] = [None] * (rows - n)
        self._copy(rows)
        if feeds:
            assert fed is not None
            self._feed(fed.tokens, rows)

    def _feed(self, tokens: torch.Tensor, rows: int) -> None:
        """On the device: each row's ``feed_rows`` entry (>= 0) of ``tokens`` becomes its input id."""
        d = self.dev
        src, ids = d.feed_rows[:rows], d.input_ids[:rows]
        ids.copy_(torch.where(src >= 0, tokens.index_select(0, src.clamp(min=0)), ids))

    def _copy(self, rows: int) -> None:
        end = self.layout.end(rows)
        self._device[:end].copy_(self._host[:end], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def batch(self, rows: int, width: int, seq_ids: tuple[int, ...], max_seq_len: int) -> FlatBatch:
        """The device views of the first ``rows`` rows (block tables ``width`` blocks wide) as a FlatBatch."""
        d = self.dev
        meta = AttentionMetadata(
            slot_mapping=d.slot_mapping[:rows],
            block_tables=d.block_tables[:rows, :width],
            seq_lens=d.seq_lens[:rows],
            query_start_loc=d.query_start_loc[: rows + 1],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )
        return FlatBatch(d.input_ids[:rows], d.positions[:rows], meta, d.sample_rows[:rows], seq_ids)
