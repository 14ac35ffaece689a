"""What the model does with tensor parallelism: which slice of each checkpoint tensor a rank reads, and the vocabulary-parallel embedding.

Where it sits: ``engine/parallel/`` computes each rank's ``RankShard`` (``parallel/shard.py``)
and implements ``TPComm`` over torch.distributed (``parallel/group.py``); the model
(``llama.py``) builds its linears at the shard's sizes and calls the collectives, and the loader
(``loader/hf_loader.py``) and the quantized loaders (``loader/hf_quant.py``, ``loader/gguf_loader.py``)
read only the shard's slice of each checkpoint tensor (:func:`checkpoint_slice`, by a model's sizes :func:`slice_for`).
The model package never imports ``engine/parallel`` at run time: it names ``RankShard`` and ``TPComm``
for the type checker only. ``None`` for
both (tp=1) is the unsharded model, unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:  # engine/parallel imports the model: named for the type checker only
    from kvfleet.engine.model.config import ModelConfig
    from kvfleet.engine.parallel.group import TPComm
    from kvfleet.engine.parallel.shard import AxisSpan, RankShard


class SliceSpec(NamedTuple):
    """Read ``span`` of axis ``dim`` of a checkpoint tensor whose axis is ``full`` long."""

    dim: int
    span: slice
    full: int


def _span(s: AxisSpan, unit: int = 1) -> slice:
    return slice(s.start * unit, s.stop * unit)


def split_span(size: int, parts: int, index: int) -> slice:
    """Part ``index`` of ``size`` cut in ``parts`` contiguous runs, the first ``size % parts`` one longer
    (``parallel/shard.contiguous_split``'s rule: each expert's intermediate columns are cut so)."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


# A mixture-of-experts expert's linears (Qwen3-MoE's names, Mixtral's): column- or row-parallel.
_EXPERT_COLUMN, _EXPERT_ROW = ("gate_proj", "up_proj", "w1", "w3"), ("down_proj", "w2")
# gpt-oss's experts stacked in one tensor each: (E, H, 2I) with gate/up columns interleaved (a
# rank's intermediate span j..k is columns 2j..2k), its bias (E, 2I), and (E, I, H): (axis, unit).
_STACKED_EXPERTS = {"gate_up_proj": (2, 2), "gate_up_proj_bias": (1, 2), "down_proj": (1, 1)}


def checkpoint_slice(name: str, shard: RankShard, head_dim: int, full: dict[str, int]) -> SliceSpec | None:
    """The slice of checkpoint tensor ``name`` that ``shard`` holds (None: all of it).

    ``full``: the unsplit sizes, ``q`` and ``kv`` (heads x head_dim), ``intermediate``, ``vocab``, and
    for a mixture-of-experts model ``expert_intermediate`` (every expert's columns are split)."""
    leaf = name.rsplit(".", 2)
    module, kind = (leaf[-2], leaf[-1]) if len(leaf) == 3 else ("", name)
    if module == "experts" and kind in _STACKED_EXPERTS:  # gpt-oss's (its down bias: whole, rank 0)
        axis, unit = _STACKED_EXPERTS[kind]
        inter = full["expert_intermediate"]
        span = split_span(inter, shard.tp_size, shard.rank)
        return SliceSpec(axis, slice(span.start * unit, span.stop * unit), inter * unit)
    if module == "self_attn" and kind == "sinks":  # gpt-oss's: one per query head
        return SliceSpec(0, shard.q_heads.scaled(1), full["q"] // head_dim)
    if ".experts." in name and module in _EXPERT_COLUMN + _EXPERT_ROW:
        inter = full["expert_intermediate"]
        span = split_span(inter, shard.tp_size, shard.rank)
        return SliceSpec(0 if module in _EXPERT_COLUMN else 1, span, inter)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return SliceSpec(0, shard.vocab.scaled(1), full["vocab"])
    if module == "q_proj":
        return SliceSpec(0, shard.q_heads.scaled(head_dim), full["q"])
    if module in ("k_proj", "v_proj"):
        return SliceSpec(0, shard.kv_heads.scaled(head_dim), full["kv"])
    if module in ("gate_proj", "up_proj"):
        return SliceSpec(0, shard.intermediate.scaled(1), full["intermediate"])
    if module == "o_proj" and kind == "weight":
        return SliceSpec(1, shard.q_heads.scaled(head_dim), full["q"])
    if module == "down_proj" and kind == "weight":
        return SliceSpec(1, shard.intermediate.scaled(1), full["intermediate"])
    return None  # norms, and o_proj's / down_proj's bias (held whole, by rank 0 only)


def slice_for(name: str, shard: RankShard, config: ModelConfig) -> SliceSpec | None:
    """:func:`checkpoint_slice` of tensor ``name`` (its Hugging Face name) for a model of ``config``."""
    full = {
        "q": config.num_heads * config.head_dim,
        "kv": config.num_kv_heads * config.head_dim,
        "intermediate": config.intermediate_size,
        "vocab": config.vocab_size,
    }
    if config.moe is not None:
        full["expert_intermediate"] = config.moe.expert_intermediate_size
    return checkpoint_slice(name, shard, config.head_dim, full)


def vocab_parallel_embed(
    embedding: torch.nn.Embedding, input_ids: torch.Tensor, shard: RankShard, comm: TPComm
) -> torch.Tensor:
    """Each rank looks up the ids in its vocabulary slice (zeros elsewhere); the all-reduce fills in the rest."""
    local = input_ids - shard.vocab.start
    outside = (local < 0) | (local >= shard.vocab.stop - shard.vocab.start)
    x = embedding(local.masked_fill(outside, 0))
    x.masked_fill_(outside[:, None], 0.0)
    comm.all_reduce(x)
    return x


def summed_over_ranks(x: torch.Tensor, comm: TPComm | None) -> torch.Tensor:
    """A row-parallel output (each rank's share of the sum) summed over the ranks in place; at tp=1
    (no ``comm``) it is the whole output already."""
    if comm is not None:
        comm.all_reduce(x)
    return x
