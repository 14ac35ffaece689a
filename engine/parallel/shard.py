"""Which heads, columns and vocabulary rows each tensor-parallel rank holds: pure functions, no torch.

Where it sits: the loader (``engine/loader/hf_loader.py``) builds each rank's model at its shard's
sizes and copies only those slices of the checkpoint; the LoRA manager slices adapters alike;
the runner sizes each rank's KV cache by its KV heads. Megatron / vLLM's split:

- q/k/v and gate/up are column-parallel (each rank computes its own output columns), o_proj and
  down_proj row-parallel (each rank multiplies its own input columns; one all-reduce sums them;
  a row-parallel bias is added once, on rank 0, before that sum).
- Attention splits by whole KV-head groups, so every query head sits on the rank holding its KV
  head and attention stays local. ``tp <= kv_heads``: the KV heads are cut into ``tp`` contiguous
  runs, the first ``kv_heads % tp`` ranks one head longer (uneven allowed), each taking the
  query heads of its KV heads. ``tp > kv_heads`` (vLLM's rule): ``tp % kv_heads == 0`` and
  ``num_heads % tp == 0``; each KV head is replicated on ``tp / kv_heads`` ranks, which split
  its group's query heads evenly.
- intermediate_size and the vocabulary are cut contiguously, the first ranks one longer.

SmolLM2-135M (9 query heads, 3 KV heads, groups of 3; intermediate 1536; vocabulary 49152) at
tp=2: rank 0 holds KV heads {0, 1} with query heads 0-5, rank 1 KV head {2} with query heads
6-8; intermediate columns 0-767 and 768-1535; vocabulary rows 0-24575 and 24576-49151. Each
rank's KV cache is sized for its own KV heads (2 and 1): the engine keeps one block count for
all ranks, the smallest any rank can hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvfleet.engine.lora.config import PROJECTION_AXES
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.errors import ModelLoadError


class AxisSpan(NamedTuple):
    """Indices ``start`` .. ``stop - 1`` of some axis (heads, columns, rows)."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def scaled(self, unit: int) -> slice:
        """The span in units of ``unit`` elements (heads → their head_dim columns)."""
        return slice(self.start * unit, self.stop * unit)


@dataclass(frozen=True)
class RankShard:
    """What rank ``rank`` of ``tp_size`` holds of every split axis."""

    rank: int
    tp_size: int
    q_heads: AxisSpan
    kv_heads: AxisSpan
    intermediate: AxisSpan
    vocab: AxisSpan

    @property
    def holds_row_parallel_bias(self) -> bool:
        """The rank that adds o_proj's and down_proj's bias (once, before the all-reduce)."""
        return self.rank == 0


def contiguous_split(size: int, parts: int, index: int) -> AxisSpan:
    """Part ``index`` of ``size`` cut in ``parts`` contiguous runs, the first ``size % parts`` one longer."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return AxisSpan(start, start + base + (1 if index < extra else 0))


def head_spans(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[AxisSpan, AxisSpan]:
    """(query heads, KV heads) of ``rank``: whole KV-head groups, or one replicated KV head."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        kv = contiguous_split(num_kv_heads, tp, rank)
        return AxisSpan(kv.start * group, kv.stop * group), kv
    if tp % num_kv_heads or num_heads % tp:
        raise ModelLoadError(
            f"tensor_parallel_size={tp} exceeds num_key_value_heads={num_kv_heads}: the KV heads are "
            f"then replicated, which needs tp % num_key_value_heads == 0 and "
            f"num_attention_heads % tp == 0 (num_attention_heads={num_heads})"
        )
    per_rank = num_heads // tp
    kv_head = rank // (tp // num_kv_heads)
    return AxisSpan(rank * per_rank, (rank + 1) * per_rank), AxisSpan(kv_head, kv_head + 1)


def rank_shard(config: ModelConfig, tp: int, rank: int) -> RankShard:
    """Rank ``rank``'s shard of a model at tensor-parallel size ``tp``; ModelLoadError if it cannot split."""
    if tp < 1 or not 0 <= rank < tp:
        raise ModelLoadError(f"rank {rank} of tensor_parallel_size={tp}: need tp >= 1 and 0 <= rank < tp")
    for name, size in (("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if size < tp:
            raise ModelLoadError(f"{name}={size} cannot be split over tensor_parallel_size={tp} ranks")
    q, kv = head_spans(config.num_heads, config.num_kv_heads, tp, rank)
    inter = contiguous_split(config.intermediate_size, tp, rank)
    vocab = contiguous_split(config.vocab_size, tp, rank)
    return RankShard(rank, tp, q, kv, inter, vocab)


def all_shards(config: ModelConfig, tp: int) -> list[RankShard]:
    """Every rank's shard, rank 0 first (the checks run for all of them at once)."""
    return [rank_shard(config, tp, r) for r in range(tp)]


def lora_slices(shard: RankShard, head_dim: int) -> dict[str, tuple[slice | None, slice | None]]:
    """Per LoRA target module, (A's input columns, B's output columns) of this rank; None: whole.

    Column-parallel modules keep A whole and cut B's outputs; row-parallel ones cut A's inputs
    and keep B whole (``engine/lora/manager.py`` says why the sum is exact)."""
    share: dict[str, slice | None] = {
        "hidden": None,
        "q": shard.q_heads.scaled(head_dim),
        "kv": shard.kv_heads.scaled(head_dim),
        "inter": shard.intermediate.scaled(1),
    }
    return {module: (share[a], share[b]) for module, (a, b) in PROJECTION_AXES.items()}
