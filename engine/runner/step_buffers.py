"""The step's input builder: one set of preallocated buffers, reused every step, for every route.

Where it sits: between the scheduler's plan and the model. The runner (``engine/runner/model_runner.py``) owns one
:class:`StepBuffers` and fills it for every step the step dispatcher (``engine/runner/step_dispatch.py``)
routes: :meth:`StepBuffers.fill` writes a decode step padded to a size of the decode path
(``engine/runner/padded_steps.py``, whose CUDA graphs replay against these addresses),
:meth:`StepBuffers.fill_plan` any other step unpadded; both write the values of the columns
:func:`kvfleet.engine.model.batch.flatten_plan` (the reference, kept for tests and benches) builds (token
ids, positions, KV slots, block tables, sequence lengths, query start locations, sample rows) into
one host buffer (pinned on CUDA only), copied to the device in one copy (on the CPU the device views
are the host's: no copy), and read through views of fixed addresses. Nothing is allocated per step.

Layout of the one byte buffer, by region (``T`` = ``max_tokens`` rows, ``S`` = ``max_seqs`` sequences,
``W`` = ``max_blocks`` per sequence): int64 ``input_ids[T]``, ``positions[T]``, ``slot_mapping[T]``,
``feed_rows[T]``, ``sample_rows[S]``, then int32 ``seq_lens[S]``, ``query_start_loc[S + 1]``,
``block_tables[S, W]``. The regions sit at fixed offsets whatever the batch, and a step copies the
prefix up to its last block-table row. In a decode step ``sample_rows`` and ``query_start_loc`` are
``arange``: written when a decode step follows another kind. A step larger than the buffers (the
scheduler's limits keep steps within them) grows them, unless CUDA graphs hold their addresses.

Async scheduling (``engine/core/async_scheduling.py``): a row whose token is not known on the host yet
(``PLACEHOLDER_TOKEN``, sampled by the step still on the device) names in ``feed_rows`` the row of the
previous step's token buffer that holds it, and :meth:`StepBuffers._feed` copies those tokens into
``input_ids`` on the device after the copy (no host round trip); other rows hold -1 there. It is
the one placeholder feeder, for every route.

Padding rows (a batch padded up to a captured size, :mod:`kvfleet.engine.runner.cuda_graphs`) decode token
0 at position 0 into ``null_slot`` (a KV slot no sequence owns) with a sequence length of 1 and a
block table of ``null_block``: they read and write only that slot, and nobody samples them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvfleet.engine.attention import AttentionMetadata
from kvfleet.engine.model.batch import FlatBatch, group_tables
from kvfleet.engine.runner.launched_step import PickedStep
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import PLACEHOLDER_TOKEN

ONE_COPY_BYTES = 256 * 1024  # a step's inputs up to this size go to the device in one copy


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of the regions in the buffer."""

    max_seqs: int
    max_blocks: int
    max_tokens: int

    @property
    def int32_start(self) -> int:
        return (4 * self.max_tokens + self.max_seqs) * 8

    @property
    def tables_start(self) -> int:
        return self.int32_start + (2 * self.max_seqs + 1) * 4

    def end(self, seqs: int) -> int:
        """The bytes a step of ``seqs`` sequences reads: everything up to its last block-table row."""
        return self.tables_start + seqs * self.max_blocks * 4

    @property
    def nbytes(self) -> int:
        return self.end(self.max_seqs)


class _Views:
    """The regions of one byte buffer as typed tensors (full size)."""

    def __init__(self, buf: torch.Tensor, layout: _Layout) -> None:
        s, w, t = layout.max_seqs, layout.max_blocks, layout.max_tokens
        i64 = buf[: layout.int32_start].view(torch.int64)
        i32 = buf[layout.int32_start : layout.nbytes].view(torch.int32)
        self.input_ids, self.positions = i64[:t], i64[t : 2 * t]
        self.slot_mapping, self.feed_rows = i64[2 * t : 3 * t], i64[3 * t : 4 * t]
        self.sample_rows = i64[4 * t :]
        self.seq_lens, self.query_start_loc = i32[:s], i32[s : 2 * s + 1]
        self.block_tables = i32[2 * s + 1 :].view(s, w)


def _token_ids(scheduled: Sequence[ScheduledSeq]) -> list[int]:
    """The step's token ids, end to end (a decode's one token without slicing its sequence)."""
    ids: list[int] = []
    for seq, start, num_new, *_ in scheduled:
        if num_new == 1:
            prompt = seq.prompt_token_ids
            ids.append(prompt[start] if start < len(prompt) else seq.output_token_ids[start - len(prompt)])
        else:
            ids.extend(seq.tokens(start, start + num_new))
    return ids


class StepBuffers:
    """Step inputs for up to ``max_tokens`` rows (default ``max_seqs``) of up to ``max_seqs``
    sequences of up to ``max_blocks`` KV blocks each."""

    def __init__(
        self, max_seqs: int, max_blocks: int, block_size: int, null_block: int, device: torch.device,
        max_tokens: int | None = None,
    ) -> None:  # fmt: skip
        self.block_size, self.device = block_size, device
        self.null_block = null_block
        self.frozen = False  # CUDA graphs hold the buffers' addresses: they never grow
        self._allocate(_Layout(max_seqs, max_blocks, max(max_tokens or max_seqs, max_seqs)))

    def _allocate(self, layout: _Layout) -> None:
        self.layout = layout
        pin = self.device.type == "cuda"
        self._host = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
        on_cpu = self.device.type == "cpu"
        self._device = (
            self._host if on_cpu else torch.zeros(layout.nbytes, dtype=torch.uint8, device=self.device)
        )
        self.host, self.dev = _Views(self._host, layout), _Views(self._device, layout)
        self._np = {name: getattr(self.host, name).numpy() for name in vars(self.host)}
        self._np["block_tables"][:] = self.null_block
        # Every row is padding until a step fills it: a warm-up or capture before the first step
        # writes only the null slot.
        self._np["slot_mapping"][:] = self.null_slot
        self._np["seq_lens"][:] = 1
        self._decode_layout = False
        self._arange()
        self._rows = np.arange(layout.max_tokens)
        self._tables: list[tuple[int, ...] | None] = [None] * layout.max_seqs
        # The last copy, on CUDA: the host buffer is busy until it ends.
        self._copied: torch.cuda.Event | None = None
        self._copy(layout.max_seqs)

    def _arange(self) -> None:
        """``sample_rows`` and ``query_start_loc`` as every decode step has them."""
        if not self._decode_layout:
            self._np["sample_rows"][:] = np.arange(self.layout.max_seqs)
            self._np["query_start_loc"][:] = np.arange(self.layout.max_seqs + 1)
            self._decode_layout = True

    @property
    def null_slot(self) -> int:
        return self.null_block * self.block_size

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy may still read the host buffer

    # Invariant: after fill(scheduled, rows), device row r < len(scheduled) holds exactly what
    # flatten_plan would put in row r for this decode step, and rows len(scheduled)..rows-1 are padding;
    # self._tables[r] is the block table host row r holds (None: unknown), so an unchanged one is not rewritten.
    def fill(self, scheduled: Sequence[ScheduledSeq], rows: int, fed: PickedStep | None = None) -> None:
        """Write a decode step (every entry one new token, sampled) padded to ``rows`` rows, and copy it;
        placeholder tokens are taken from ``fed``, the previous step's tokens, on the device."""
        self._wait()
        self._arange()
        n, bs, a = len(scheduled), self.block_size, self._np
        ids = self._write_tables_and_ids(scheduled)
        a["positions"][:n] = [s.num_computed_before for s in scheduled]
        p = a["positions"][:n]
        a["slot_mapping"][:n] = a["block_tables"][self._rows[:n], p // bs] * bs + p % bs
        np.add(p, 1, out=a["seq_lens"][:n], casting="unsafe")
        a["input_ids"][n:rows], a["positions"][n:rows], a["slot_mapping"][n:rows] = 0, 0, self.null_slot
        a["seq_lens"][n:rows] = 1
        a["block_tables"][n:rows, 0] = self.null_block
        self._tables[n:rows] = [None] * (rows - n)
        feeds = self._placeholders(scheduled, ids, rows, fed)
        self._copy(rows, rows)
        if feeds:
            assert fed is not None
            self._feed(fed.tokens, rows)

    # Invariant: after fill_plan(plan), the device views it returns hold exactly flatten_plan's batch
    # for the plan; self._tables[r] is still the block table host row r holds.
    def fill_plan(self, plan: SchedulerPlan, fed: PickedStep | None = None) -> FlatBatch:
        """Write any step unpadded, copy it, and return its batch over the device views."""
        s = plan.scheduled
        n, bs = len(s), self.block_size
        start = np.fromiter((e.num_computed_before for e in s), np.int64, n)
        num_new = np.fromiter((e.num_new_tokens for e in s), np.int64, n)
        lens = np.fromiter((len(e.block_ids) for e in s), np.int64, n)
        end, tokens, width = start + num_new, int(num_new.sum()), int(lens.max())
        short = np.flatnonzero(lens * bs < end)
        if short.size:
            r = int(short[0])
            raise ValueError(f"seq {s[r].seq.seq_id}: {lens[r]} blocks of {bs} cannot hold {end[r]} tokens")
        self._ensure(tokens, n, width)
        self._wait()
        a = self._np
        self._decode_layout = False
        ids = self._write_tables_and_ids(s)
        qsl = a["query_start_loc"][: n + 1]
        qsl[0] = 0
        np.cumsum(num_new, out=qsl[1:])
        row_seq = np.repeat(np.arange(n), num_new)  # each row's sequence
        positions = a["positions"][:tokens]
        np.add(self._rows[:tokens] - qsl[row_seq], start[row_seq], out=positions)
        blocks = a["block_tables"][row_seq, positions // bs].astype(np.int64)
        a["slot_mapping"][:tokens] = blocks * bs + positions % bs
        a["seq_lens"][:n] = end
        samples = np.fromiter((e.seq.num_tokens for e in s), np.int64, n) == end
        sampled = int(samples.sum())
        a["sample_rows"][:sampled] = qsl[1:][samples] - 1
        feeds = self._placeholders(s, ids, tokens, fed)
        self._copy(n, tokens)
        if feeds:
            assert fed is not None
            self._feed(fed.tokens, tokens)
        seq_ids = tuple(e.seq.seq_id for e, x in zip(s, samples.tolist(), strict=True) if x)
        batch = self._flat(tokens, n, width, sampled, seq_ids, int(num_new.max()), int(end.max()))
        if s[0].group_block_ids:  # several KV cache groups: theirs built fresh, beside the buffers
            groups = group_tables(s, lens, row_seq, positions, bs, self.device)
            batch = dataclasses.replace(batch, meta=dataclasses.replace(batch.meta, kv_groups=groups))
        return batch

    def _flat(
        self, tokens: int, seqs: int, width: int, sampled: int, seq_ids: tuple[int, ...],
        max_query_len: int, max_seq_len: int,
    ) -> FlatBatch:  # fmt: skip
        d = self.dev
        meta = AttentionMetadata(
            slot_mapping=d.slot_mapping[:tokens],
            block_tables=d.block_tables[:seqs, :width],
            seq_lens=d.seq_lens[:seqs],
            query_start_loc=d.query_start_loc[: seqs + 1],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        return FlatBatch(d.input_ids[:tokens], d.positions[:tokens], meta, d.sample_rows[:sampled], seq_ids)

    def _ensure(self, tokens: int, seqs: int, width: int) -> None:
        """Room for a step of this size: the buffers grow (never shrink) unless graphs hold them."""
        old = self.layout
        if tokens <= old.max_tokens and seqs <= old.max_seqs and width <= old.max_blocks:
            return
        if self.frozen:
            raise ValueError(
                f"a step of {tokens} rows, {seqs} sequences, {width} blocks wide exceeds the step buffers "
                f"({old.max_tokens}, {old.max_seqs}, {old.max_blocks}) CUDA graphs were captured over"
            )
        self._wait()
        layout = _Layout(max(seqs, old.max_seqs), max(width, old.max_blocks), max(tokens, old.max_tokens))
        self._allocate(layout)

    def _write_tables_and_ids(self, scheduled: Sequence[ScheduledSeq]) -> list[int]:
        """Each sequence's block table where it changed, and the step's token ids; returns the ids."""
        tables, known = self._np["block_tables"], self._tables
        for r, s in enumerate(scheduled):
            if known[r] != s.block_ids:  # a new sequence in this row, or a new block: rewrite it
                tables[r, : len(s.block_ids)] = s.block_ids
                tables[r, len(s.block_ids) :] = 0  # as flatten_plan pads a table
                known[r] = s.block_ids
        ids = _token_ids(scheduled)
        self._np["input_ids"][: len(ids)] = ids
        return ids

    def _placeholders(
        self, scheduled: Sequence[ScheduledSeq], ids: list[int], rows: int, fed: PickedStep | None
    ) -> bool:
        """Before the copy: ``feed_rows`` names, for each row still holding a placeholder, its
        sequence's row in ``fed``'s tokens (-1 elsewhere); whether any row does."""
        if PLACEHOLDER_TOKEN not in ids:
            return False
        assert fed is not None, "a placeholder token without the step that samples it"
        rows_of, feed = fed.rows_of, self._np["feed_rows"]
        feed[:rows] = -1
        row = 0
        for s in scheduled:
            row += s.num_new_tokens
            if ids[row - 1] == PLACEHOLDER_TOKEN:  # only a sequence's last known token is one
                feed[row - 1] = rows_of[s.seq.seq_id]
        return True

    def _feed(self, tokens: torch.Tensor, rows: int) -> None:
        """On the device: each row's ``feed_rows`` entry (>= 0) of ``tokens`` becomes its input id."""
        d = self.dev
        src, ids = d.feed_rows[:rows], d.input_ids[:rows]
        ids.copy_(torch.where(src >= 0, tokens.index_select(0, src.clamp(min=0)), ids))

    def _copy(self, seqs: int, tokens: int | None = None) -> None:
        """Host to device: the prefix up to block-table row ``seqs``, in one copy; where that prefix
        is large (the token regions sized for long unchunked prompts), the used part of each region."""
        if self._device is self._host:
            return
        end = self.layout.end(seqs)
        if end <= ONE_COPY_BYTES or tokens is None:
            self._device[:end].copy_(self._host[:end], non_blocking=True)
        else:
            t = self.layout.max_tokens * 8
            spans = [(i * t, i * t + tokens * 8) for i in range(4)] + [(4 * t, end)]
            for lo, hi in spans:
                self._device[lo:hi].copy_(self._host[lo:hi], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def batch(self, rows: int, width: int, seq_ids: tuple[int, ...], max_seq_len: int) -> FlatBatch:
        """The device views of a decode step's first ``rows`` rows (block tables ``width`` blocks wide)."""
        return self._flat(rows, rows, width, rows, seq_ids, 1, max_seq_len)
