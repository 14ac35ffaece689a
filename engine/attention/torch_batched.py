"""The torch backend's fast path: a step's sequences in a few padded SDPA calls, planned once per step.

Where it sits: ``TorchAttentionBackend.forward`` (``torch_backend.py``) calls
:meth:`BatchedAttention.forward` for every layer of a step. The first layer's call turns
the step's :class:`AttentionMetadata` into a :class:`StepLayout` (which sequences share a
call, their padded query rows, the cache slot of each key row and their attention mask);
the other layers of the same step reuse it, so the per-layer work is one gather of K/V
rows and one ``scaled_dot_product_attention`` per group. ``paged_attention_reference`` (the loop
over sequences) stays the oracle this path is tested against.

Groups: decoding sequences (one query row) and prefill chunks are grouped apart, each
sorted by length and cut into a few buckets, so keys are padded to the bucket's longest
context rather than the step's. Grouped-query heads fold into the query axis (the ``g``
query heads of one KV head become ``g`` rows per token), so K/V are never repeated.

Fresh prompts: a prompt whose first chunk is this step's (no cached context) skips all of
that: its keys are its own rows, attended in unpadded query tiles (:class:`Fresh`).

Attention sinks (``LayerKV.sinks``): SDPA has no extra logit, so a layer with sinks runs the same
groups and masks through :func:`sink_attention`, the softmax written out with the sink column.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvfleet.engine.attention.base import AttentionMetadata, LayerKV

DECODE_BUCKET = 8  # decoding sequences per SDPA call, at least (fewer, longer calls beat many short ones)
MAX_DECODE_BUCKETS = 4
PREFILL_BUCKET = 4  # prefill tiles per SDPA call, at least
PREFILL_TILE = 128  # query rows per prefill tile
FRESH_TILE = 64  # query rows per tile of a prompt attended from its first token
SEQ_LEN = 2  # Span field the buckets sort by


def key_allowed(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query row may attend: causal, and within the sliding window if there is one.

    ``query_pos``: (G, Lq) positions of the query rows; ``key_pos``: (Lk,). Returns (G, Lq, Lk)
    bool: key p is allowed for the row at position q iff p <= q (and q - window < p). Keys past
    a sequence's length (padding) are excluded because every query position is below the length.
    """
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]
    if window is not None:
        allowed &= key_pos[None, None, :] > query_pos[:, :, None] - window
    return allowed


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, mask)`` with one more logit per query row, ``sinks``
    (broadcast to q's rows: (..., Lq, 1)), in the softmax and dropped after it (it has no value)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + mask
    logits = torch.cat((scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)), dim=-1)
    return torch.matmul(torch.softmax(logits, dim=-1)[..., :-1], v)


class CacheGeometry(NamedTuple):
    """What a layout depends on besides the metadata: the cache's block size, the GQA group, the dtype."""

    block_size: int
    group_size: int  # query heads per KV head
    dtype: torch.dtype  # of the computation (and of the additive mask)
    device: torch.device


@dataclass
class Group:
    """Sequences attended in one SDPA call; G sequences, each padded to Lq query rows and nb blocks of keys."""

    q_rows: torch.Tensor  # (G * Lq,) int64: flat query row of each padded row (padding repeats a real row)
    out_index: torch.Tensor | None  # (R,) int64: which padded rows are real (None: all of them)
    out_rows: torch.Tensor  # (R,) int64: the flat output row of each real padded row
    key_slots: torch.Tensor  # (G * nb * block_size,) int64: the cache slot of each padded key row
    query_pos: torch.Tensor  # (G, Lq) int64: the position of each padded query row
    num_seqs: int
    query_len: int
    num_blocks: int
    geo: CacheGeometry
    # window → (G, 1, Lq * g, nb * block_size) additive mask (0 where key_allowed, -inf elsewhere),
    # built once per step and window: SDPA takes it as is (a bool mask is converted per call).
    _biases: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def bias(self, window: int | None) -> torch.Tensor:
        mask = self._biases.get(window)
        if mask is None:
            n, lq, g = self.num_seqs, self.query_len, self.geo.group_size
            key_pos = torch.arange(self.num_blocks * self.geo.block_size, device=self.query_pos.device)
            allowed = key_allowed(self.query_pos, key_pos, window)
            allowed = allowed[:, :, None, :].expand(-1, -1, g, -1).reshape(n, 1, lq * g, -1)
            mask = torch.zeros(allowed.shape, dtype=self.geo.dtype, device=allowed.device)
            mask = self._biases[window] = mask.masked_fill_(~allowed, float("-inf"))
        return mask


@dataclass
class Fresh:
    """A prompt computed from its first token in this step: ``num_rows`` flat rows from ``first_row``.

    Its keys are exactly its own new rows, so it needs no padding: it is attended in query
    tiles of ``FRESH_TILE`` rows, each over the keys up to its own last row with the causal
    mask of that diagonal block only. (The CPU's causal SDPA skips nothing below 512 keys, so
    at 512 rows it computed the whole square: 3.1 ms a layer on SmolLM2, the tiles 2.2 ms.)
    """

    first_row: int
    num_rows: int
    key_slots: torch.Tensor  # (num_rows,) int64: the cache slot of each of its rows, from its block table
    _masks: dict[tuple[int | None, torch.dtype], list[torch.Tensor]] = field(default_factory=dict)

    def tiles(self) -> list[tuple[int, int]]:
        """(lo, hi) rows of each query tile, relative to the prompt."""
        return [(lo, min(lo + FRESH_TILE, self.num_rows)) for lo in range(0, self.num_rows, FRESH_TILE)]

    def masks(self, window: int | None, dtype: torch.dtype) -> list[torch.Tensor]:
        """The additive mask of each tile, (hi - lo, hi): built once per step, window and dtype."""
        key = (window, dtype)
        if key not in self._masks:
            device = self.key_slots.device
            self._masks[key] = [
                torch.zeros(hi - lo, hi, dtype=dtype, device=device).masked_fill_(
                    ~key_allowed(
                        torch.arange(lo, hi, device=device)[None], torch.arange(hi, device=device), window
                    )[0],
                    float("-inf"),
                )
                for lo, hi in self.tiles()
            ]
        return self._masks[key]


def _fresh_span(first_row: int, rows: int, table: list[int], block_size: int, device: torch.device) -> Fresh:
    pos = torch.arange(rows)
    blocks = torch.tensor(table[: -(-rows // block_size)], dtype=torch.int64)
    return Fresh(first_row, rows, (blocks[pos // block_size] * block_size + pos % block_size).to(device))


@dataclass(frozen=True)
class StepLayout:
    groups: tuple[Group, ...]  # the SDPA calls of the step
    decode_seqs: torch.Tensor | None = None  # (S_dec,) int64: decodes left to a native kernel (None: none)
    fresh: tuple[Fresh, ...] = ()  # prompts starting at token 0 this step: a causal call each

    @property
    def has_prefill(self) -> bool:
        return bool(self.groups or self.fresh)


class Span(NamedTuple):
    """Query rows attended together: ``num_rows`` rows from flat row ``first_row``, the last at
    position ``seq_len - 1``, over the keys of ``table``. A decode is one span of one row; a
    prefill chunk is cut into spans of at most ``PREFILL_TILE`` rows, each seeing only the keys
    up to its own last row, so the causal upper triangle beyond a tile is never computed."""

    first_row: int
    num_rows: int
    seq_len: int
    table: list[int]


def _buckets(spans: list[Span], key: int, size: int, max_buckets: int | None) -> list[list[Span]]:
    """Cut spans (sorted by field ``key``) into runs of at least ``size``, at most ``max_buckets`` runs."""
    ranked = sorted(spans, key=lambda span: span[key])
    count = max(1, len(ranked) // size)
    if max_buckets is not None:
        count = min(count, max_buckets)
    per = -(-len(ranked) // count)
    return [ranked[i : i + per] for i in range(0, len(ranked), per)]


def _tiles(first_row: int, num_rows: int, seq_len: int, table: list[int]) -> list[Span]:
    spans = []
    for lo in range(0, num_rows, PREFILL_TILE):
        rows = min(PREFILL_TILE, num_rows - lo)
        spans.append(Span(first_row + lo, rows, seq_len - (num_rows - lo - rows), table))
    return spans


def _group(spans: list[Span], geo: CacheGeometry) -> Group:
    # Invariant: padded query row i of span s sits at position start_s + min(i, rows_s - 1) and
    # reads query row first_s + min(i, rows_s - 1), so a padding row repeats a real one and is never
    # fully masked; a padding key row reads the sequence's own position-0 slot (stored, so finite)
    # and is masked, so a sequence never reads a slot it did not store (stale or NaN contents).
    block_size = geo.block_size
    width = max(span.num_rows for span in spans)
    num_blocks = -(-max(span.seq_len for span in spans) // block_size)
    q_rows: list[int] = []
    positions: list[int] = []
    out_index: list[int] = []
    out_rows: list[int] = []
    tables_padded: list[list[int]] = []
    for n, (first, rows, seq_len, table) in enumerate(spans):
        first_pos = seq_len - rows
        for i in range(width):
            j = min(i, rows - 1)
            q_rows.append(first + j)
            positions.append(first_pos + j)
        out_index.extend(range(n * width, n * width + rows))
        out_rows.extend(range(first, first + rows))
        table = table[:num_blocks]
        tables_padded.append(table + [table[0]] * (num_blocks - len(table)))
    query_pos = torch.tensor(positions, dtype=torch.int64).view(len(spans), width)
    key_pos = torch.arange(num_blocks * block_size)
    padded = len(out_rows) != len(q_rows)
    lens = torch.tensor([span.seq_len for span in spans], dtype=torch.int64)
    key_at = torch.where(key_pos[None, :] < lens[:, None], key_pos[None, :], 0)
    table_t = torch.tensor(tables_padded, dtype=torch.int64)
    key_slots = table_t.gather(1, key_at // block_size) * block_size + key_at % block_size
    return Group(
        q_rows=torch.tensor(q_rows, dtype=torch.int64),
        out_index=torch.tensor(out_index, dtype=torch.int64) if padded else None,
        out_rows=torch.tensor(out_rows, dtype=torch.int64),
        key_slots=key_slots.view(-1),
        query_pos=query_pos,
        num_seqs=len(spans),
        query_len=width,
        num_blocks=num_blocks,
        geo=geo,
    )


def plan_step(meta: AttentionMetadata, geo: CacheGeometry, sdpa_decodes: bool = True) -> StepLayout:
    """Group the step's sequences into padded SDPA calls (decodes and prefill tiles apart).

    ``sdpa_decodes=False``: the decoding sequences get no SDPA call; the layout lists them in
    ``decode_seqs`` for a kernel that reads the paged cache in place.
    """
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    tables = meta.block_tables.tolist()
    decode: list[int] = []
    tiles: list[Span] = []
    fresh: list[Fresh] = []
    for s, seq_len in enumerate(seq_lens):
        rows = starts[s + 1] - starts[s]
        if rows == 1:
            decode.append(s)
        elif rows == seq_len:
            fresh.append(_fresh_span(starts[s], rows, tables[s], geo.block_size, geo.device))
        else:
            tiles += _tiles(starts[s], rows, seq_len, tables[s])
    runs = []
    if decode and sdpa_decodes:
        spans = [Span(starts[s], 1, seq_lens[s], tables[s]) for s in decode]
        runs += _buckets(spans, SEQ_LEN, DECODE_BUCKET, MAX_DECODE_BUCKETS)
    if tiles:
        runs += _buckets(tiles, SEQ_LEN, PREFILL_BUCKET, None)
    groups = [_group(run, geo) for run in runs]
    if geo.device.type != "cpu":
        groups = [_to(grp, geo.device) for grp in groups]
    native = None if sdpa_decodes or not decode else torch.tensor(decode, dtype=torch.int64)
    return StepLayout(tuple(groups), native, tuple(fresh))


def _to(grp: Group, device: torch.device) -> Group:
    return Group(
        q_rows=grp.q_rows.to(device),
        out_index=None if grp.out_index is None else grp.out_index.to(device),
        out_rows=grp.out_rows.to(device),
        key_slots=grp.key_slots.to(device),
        query_pos=grp.query_pos.to(device),
        num_seqs=grp.num_seqs,
        query_len=grp.query_len,
        num_blocks=grp.num_blocks,
        geo=grp.geo,
    )


class BatchedAttention:
    """Holds the current step's layout and the scratch buffers K/V rows are gathered into.

    The scratch buffers grow to the largest group seen and are reused by every layer and
    step: gathering into fresh tensors of a few MB each would page-fault on every call.
    """

    def __init__(self, sdpa_decodes: bool = True) -> None:
        self.sdpa_decodes = sdpa_decodes
        self._key: tuple[AttentionMetadata, CacheGeometry] | None = None
        self._layout = StepLayout(())
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def layout(self, meta: AttentionMetadata, geo: CacheGeometry) -> StepLayout:
        # A new step: every layer of one step shares the metadata object (compared by identity).
        if self._key is None or self._key[0] is not meta or self._key[1] != geo:
            self._layout = plan_step(meta, geo, self.sdpa_decodes)
            self._key = (meta, geo)
        return self._layout

    @staticmethod
    def geometry(q: torch.Tensor, k_cache: torch.Tensor) -> CacheGeometry:
        group = q.shape[1] // k_cache.shape[2]
        return CacheGeometry(k_cache.shape[1], group, torch.promote_types(q.dtype, k_cache.dtype), q.device)

    def _buffers(self, k_cache: torch.Tensor, rows: int) -> torch.Tensor:
        """(2, rows, kv_heads * head_dim), contiguous: the K rows then the V rows of one group."""
        key = (k_cache.dtype, k_cache.device)
        width = k_cache[0, 0].numel()  # one token's keys: num_kv_heads * head_dim
        flat = self._scratch.get(key, k_cache.new_empty(0))
        if flat.numel() < 2 * rows * width:
            flat = self._scratch[key] = k_cache.new_empty(2 * rows * width)
        return flat[: 2 * rows * width].view(2, rows, width)

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        # One index_select for K and V when V's cache directly follows K's in memory (the runner's
        # one (2, blocks, ...) tensor per layer): the same rows as two gathers, in ~30% less time.
        kv = self._buffers(k_cache, slots.shape[0])
        rows, width = k_cache.shape[0] * k_cache.shape[1], kv.shape[2]
        paired = (
            k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and v_cache.data_ptr() == k_cache.data_ptr() + k_cache.numel() * k_cache.element_size()
        )
        if paired:
            both = k_cache.as_strided((2, rows, width), (rows * width, width, 1))
            torch.index_select(both, 1, slots, out=kv)
        else:
            kv[0] = k_cache.view(rows, width).index_select(0, slots)
            kv[1] = v_cache.view(rows, width).index_select(0, slots)
        return kv

    def forward(
        self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of the rows the layout's groups cover, written into ``out`` (new if None)."""
        k_cache, v_cache, scale, window, sinks = layer
        block_size, kv_heads, head_dim = k_cache.shape[1:]
        heads = q.shape[1]
        g = heads // kv_heads
        layout = self.layout(meta, self.geometry(q, k_cache))
        dtype = torch.promote_types(q.dtype, k_cache.dtype)
        out = torch.empty_like(q) if out is None else out
        for span in layout.fresh:
            self._fresh(q, layer, span, out)
        for grp in layout.groups:
            n, lq, keys = grp.num_seqs, grp.query_len, grp.num_blocks * block_size
            kv = self._gather(k_cache, v_cache, grp.key_slots)
            k = kv[0].view(n, keys, kv_heads, head_dim).transpose(1, 2)
            v = kv[1].view(n, keys, kv_heads, head_dim).transpose(1, 2)
            qg = q.index_select(0, grp.q_rows).view(n, lq, kv_heads, g, head_dim)
            qg = qg.transpose(1, 2).reshape(n, kv_heads, lq * g, head_dim)
            if k.dtype != dtype or qg.dtype != dtype:  # mixed precision only; float32 copies nothing
                qg, k, v = qg.to(dtype), k.to(dtype), v.to(dtype)
            if sinks is None:
                o = F.scaled_dot_product_attention(qg, k, v, attn_mask=grp.bias(window), scale=scale)
            else:  # folded rows are (token, head in group): head kh * g + j at row i * g + j
                row_sinks = sinks.view(kv_heads, 1, g).expand(-1, lq, -1).reshape(1, kv_heads, lq * g, 1)
                o = sink_attention(qg, k, v, grp.bias(window), scale, row_sinks)
            o = o.view(n, kv_heads, lq, g, head_dim).transpose(1, 2).reshape(n * lq, heads, head_dim)
            if grp.out_index is not None:
                o = o.index_select(0, grp.out_index)
            out.index_copy_(0, grp.out_rows, o if o.dtype == q.dtype else o.to(q.dtype))
        return out

    def _fresh(self, q: torch.Tensor, layer: LayerKV, span: Fresh, out: torch.Tensor) -> None:
        """One prompt from its first token: its own K/V rows, a masked SDPA call per query tile."""
        k_cache, v_cache, scale, window, sinks = layer
        kv_heads, head_dim = k_cache.shape[2:]
        first, rows = span.first_row, span.num_rows
        kv = self._gather(k_cache, v_cache, span.key_slots)
        k = kv[0].view(rows, kv_heads, head_dim).transpose(0, 1)[None]
        v = kv[1].view(rows, kv_heads, head_dim).transpose(0, 1)[None]
        qs = q[first : first + rows].transpose(0, 1)[None]
        dtype = torch.promote_types(q.dtype, k_cache.dtype)
        if k.dtype != dtype or qs.dtype != dtype:  # mixed precision only
            qs, k, v = qs.to(dtype), k.to(dtype), v.to(dtype)
        if sinks is not None:  # sink_attention broadcasts no grouped heads: K/V repeated per query head
            g = qs.shape[1] // kv_heads
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        for (lo, hi), mask in zip(span.tiles(), span.masks(window, dtype), strict=True):
            if sinks is None:
                o = F.scaled_dot_product_attention(
                    qs[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], attn_mask=mask, scale=scale, enable_gqa=True
                )
            else:
                o = sink_attention(
                    qs[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], mask, scale, sinks.view(1, -1, 1, 1)
                )
            out[first + lo : first + hi] = o[0].transpose(0, 1)
