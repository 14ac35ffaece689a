"""The KV tensors of the layers, laid out by their KV cache groups (``engine/kv/groups.py``).

Where it sits: the runner (rank 0) and each tensor-parallel worker allocate their paged KV cache
here, so every rank lays it out alike. With one group, one tensor per layer (as ever); with several,
``layout.num_tensors`` tensors, the i-th layer of every group writing tensor i: one block id is one
page of them, owned by whichever group holds the block.
"""

from __future__ import annotations

import torch

from kvfleet.engine.kv.groups import KVLayout


def layer_kv_caches(
    layout: KVLayout, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Each layer's KV tensor of ``shape`` (2, num_blocks, block_size, kv_heads, head_dim)."""
    tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_tensors)]
    return [tensors[t] for t in layout.tensor_of]
