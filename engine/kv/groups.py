"""KV cache groups: which layers share a block table, and which KV tensor each layer writes.

Where it sits: the runner (and each tensor-parallel worker) lays out its KV tensors by
:func:`kv_layout`; the engine gives the group windows to the ``KVCacheManager``; each attention
layer reads its group's block table (``AttentionMetadata.for_kv_group``). Torch-free.

As vLLM's hybrid allocator (its KV cache coordinator): the layers are grouped by attention type
(full, or sliding with window W), and each type's layers are cut into groups of ``k`` layers,
``k`` the fewest layers of any type. Every group has its own block table per sequence, all drawn
from ONE pool of block ids, and a block id names one page of ``k`` KV tensors: the ``i``-th layer of
every group writes KV tensor ``i``. So a page costs ``k`` layers' KV whoever holds it, and a
sliding group's blocks, freed as they fall out of its window, serve any group next (one shared
pool with equal pages: no pool of one type sits idle while the other runs short). A group with fewer
than ``k`` layers (a type's last cut) leaves the rest of its pages unused, as vLLM pads it.

A model with one attention type (every Llama) is one group of all its layers, KV tensor ``i``
for layer ``i``: today's one table per sequence, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention (reads every key)
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    group_of: tuple[int, ...]  # per layer: its group's index
    tensor_of: tuple[int, ...]  # per layer: which KV tensor (page slot) it writes
    num_tensors: int  # k: the layers one block id's page holds

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1


# Invariant: every layer is in exactly one group; within a group, layers write distinct tensors.
def kv_layout(layer_windows: tuple[int | None, ...], num_layers: int) -> KVLayout:
    """Group ``num_layers`` layers by their windows (``layer_windows`` empty: all full attention)."""
    windows = layer_windows or (None,) * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"layer_windows names {len(windows)} layers, the model has {num_layers}")
    by_type: dict[int | None, list[int]] = {}
    for layer in sorted(range(num_layers), key=lambda i: (windows[i] is not None, windows[i] or 0, i)):
        by_type.setdefault(windows[layer], []).append(layer)  # full attention first, as vLLM orders
    if len(by_type) == 1:
        every = tuple(range(num_layers))
        return KVLayout(
            (KVGroup(windows[0] if windows else None, every),), (0,) * num_layers, every, num_layers
        )
    k = min(len(layers) for layers in by_type.values())
    groups: list[KVGroup] = []
    group_of, tensor_of = [0] * num_layers, [0] * num_layers
    for window, layers in by_type.items():
        for start in range(0, len(layers), k):
            cut = tuple(layers[start : start + k])
            for slot, layer in enumerate(cut):
                group_of[layer], tensor_of[layer] = len(groups), slot
            groups.append(KVGroup(window, cut))
    return KVLayout(tuple(groups), tuple(group_of), tuple(tensor_of), k)
