"""What the model needs of tensor parallelism: a rank's shard (sizes) and its collectives, as Protocols.

Where it sits: ``engine/parallel/`` computes each rank's :class:`ShardSpec` (``parallel/shard.py``)
and implements :class:`Collective` over torch.distributed (``parallel/group.py``); the model
(``llama.py``) builds its linears at the shard's sizes and calls the collectives, and the loader
(``loader.py``) reads only the shard's slice of each checkpoint tensor (:func:`checkpoint_slice`).
The model package never imports ``engine/parallel``: it sees only these Protocols. ``None`` for
both (tp=1) is the unsharded model, unchanged.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class SpanLike(Protocol):
    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...


class ShardSpec(Protocol):
    """One rank's share of each split axis (``kvfleet.engine.parallel.shard.RankShard``)."""

    @property
    def rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def q_heads(self) -> SpanLike: ...
    @property
    def kv_heads(self) -> SpanLike: ...
    @property
    def intermediate(self) -> SpanLike: ...
    @property
    def vocab(self) -> SpanLike: ...
    @property
    def holds_row_parallel_bias(self) -> bool: ...


class Collective(Protocol):
    """The two collectives of a tensor-parallel forward (``kvfleet.engine.parallel.group.TPComm``)."""

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place (after each row-parallel matmul and the embedding)."""

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's vocabulary slice of the logits side by side, (rows, vocab). Other
        ranks: ``local`` (nobody reads it)."""


class SliceSpec(NamedTuple):
    """Read ``span`` of axis ``dim`` of a checkpoint tensor whose axis is ``full`` long."""

    dim: int
    span: slice
    full: int


def _span(s: SpanLike, unit: int = 1) -> slice:
    return slice(s.start * unit, s.stop * unit)


def split_span(size: int, parts: int, index: int) -> slice:
    """Part ``index`` of ``size`` cut in ``parts`` contiguous runs, the first ``size % parts`` one longer
    (``parallel/shard.contiguous_split``'s rule: each expert's intermediate columns are cut so)."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


# A mixture-of-experts expert's linears (Qwen3-MoE's names, Mixtral's): column- or row-parallel.
_EXPERT_COLUMN, _EXPERT_ROW = ("gate_proj", "up_proj", "w1", "w3"), ("down_proj", "w2")


def checkpoint_slice(name: str, shard: ShardSpec, head_dim: int, full: dict[str, int]) -> SliceSpec | None:
    """The slice of checkpoint tensor ``name`` that ``shard`` holds (None: all of it).

    ``full``: the unsplit sizes, ``q`` and ``kv`` (heads x head_dim), ``intermediate``, ``vocab``, and
    for a mixture-of-experts model ``expert_intermediate`` (every expert's columns are split)."""
    leaf = name.rsplit(".", 2)
    module, kind = (leaf[-2], leaf[-1]) if len(leaf) == 3 else ("", name)
    if ".experts." in name and module in _EXPERT_COLUMN + _EXPERT_ROW:
        inter = full["expert_intermediate"]
        span = split_span(inter, shard.tp_size, shard.rank)
        return SliceSpec(0 if module in _EXPERT_COLUMN else 1, span, inter)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return SliceSpec(0, _span(shard.vocab), full["vocab"])
    if module == "q_proj":
        return SliceSpec(0, _span(shard.q_heads, head_dim), full["q"])
    if module in ("k_proj", "v_proj"):
        return SliceSpec(0, _span(shard.kv_heads, head_dim), full["kv"])
    if module in ("gate_proj", "up_proj"):
        return SliceSpec(0, _span(shard.intermediate), full["intermediate"])
    if module == "o_proj" and kind == "weight":
        return SliceSpec(1, _span(shard.q_heads, head_dim), full["q"])
    if module == "down_proj" and kind == "weight":
        return SliceSpec(1, _span(shard.intermediate), full["intermediate"])
    return None  # norms, and o_proj's / down_proj's bias (held whole, by rank 0 only)


def vocab_parallel_embed(
    embedding: torch.nn.Embedding, input_ids: torch.Tensor, shard: ShardSpec, comm: Collective
) -> torch.Tensor:
    """Each rank looks up the ids in its vocabulary slice (zeros elsewhere); the all-reduce fills in the rest."""
    local = input_ids - shard.vocab.start
    outside = (local < 0) | (local >= shard.vocab.stop - shard.vocab.start)
    x = embedding(local.masked_fill(outside, 0))
    x.masked_fill_(outside[:, None], 0.0)
    comm.all_reduce(x)
    return x
