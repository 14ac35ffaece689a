"""The attention interface of the model runner: store new K/V into the paged cache, attend.

Where it sits: the runner builds one :class:`AttentionMetadata` per step from the
scheduler's plan; every attention layer calls ``backend.store_kv`` then
``backend.forward``. Backends are picked by name (``engine/attention/registry.py``);
``torch`` is the reference and the CPU default, ``triton`` runs the kernels in ``engine/kernels``.

Shapes (T = tokens in the step, S = sequences in the step):
- ``q``: (T, num_heads, head_dim); ``k``, ``v``: (T, num_kv_heads, head_dim)
- ``k_cache``, ``v_cache``: (num_blocks, block_size, num_kv_heads, head_dim), one pair
  per layer (views of one preallocated tensor of shape (2, num_blocks, block_size,
  num_kv_heads, head_dim))
- ``slot_mapping``: (T,) int64, the cache slot ``block_id * block_size + offset`` of
  each new token
- ``block_tables``: (S, max_blocks_per_seq) int32, padded with 0
- ``kv_groups``: with several KV cache groups (``engine/kv/groups.py``: Gemma 3's sliding and global
  layers), groups 1..'s (``slot_mapping``, ``block_tables``); a layer of group g attends over
  ``meta.for_kv_group(g)``. Empty with one group.
- ``seq_lens``: (S,) int32, tokens in the cache after this step (context length)
- ``query_start_loc``: (S + 1,) int32, cumulative query lengths; sequence ``s`` owns
  query rows ``query_start_loc[s]:query_start_loc[s + 1]``

Causality: query row ``i`` of sequence ``s`` sits at position
``seq_lens[s] - query_len[s] + i`` and attends to keys ``0..position`` inclusive. With a
``sliding_window`` W (per layer, in the :class:`LayerKV` given to ``forward``) it attends to keys
``max(0, position - W + 1)..position``: W keys, itself included, as transformers'
``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``).

Attention sinks (gpt-oss; ``LayerKV.sinks``, one float32 logit per query head): each head's
softmax takes one more logit, ``sinks[h]``, that has no value row: the weights over the keys are
``exp(s_i) / (sum_j exp(s_j) + exp(sinks[h]))`` and sum to less than one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from kvfleet.engine.lora.context import LoraContext


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    lora: LoraContext | None = None  # the step's adapters (engine/lora); None: base model only
    kv_groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # groups 1..: (slot_mapping, block_tables)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def for_kv_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV cache group ``group`` reads (itself for group 0)."""
        if group == 0:
            return self
        if not self.kv_groups:
            if self.slot_mapping.numel() == 0:  # no paged cache at all (the pooler's step): nothing to pick
                return self
            raise ValueError(f"the step has no block tables of KV cache group {group}")
        slot_mapping, block_tables = self.kv_groups[group - 1]
        return replace(self, slot_mapping=slot_mapping, block_tables=block_tables, kv_groups=())


class LayerKV(NamedTuple):
    """One attention layer as a backend sees it: its paged K and V caches and its parameters."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    sliding_window: int | None = None  # None: full causal attention
    sinks: torch.Tensor | None = None  # (num_heads,) float32: a softmax logit per head with no value


class AttentionBackend(Protocol):
    name: str

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: LayerKV, slot_mapping: torch.Tensor) -> None:
        """Write the step's new keys and values into ``layer``'s cache at ``slot_mapping``."""

    def forward(self, q: torch.Tensor, layer: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of every query row over its sequence's cached keys (causal, windowed)."""
