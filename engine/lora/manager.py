"""The adapters an engine knows, holds in CPU memory and has resident in device slots.

Where it sits: owned by the ``ModelRunner`` (``runner.lora``); the ``Engine`` registers and
unregisters adapters through it (start-up ``--lora-modules``, the load/unload endpoints) and
the runner asks it, each step, for a :class:`~kvfleet.engine.lora.context.LoraContext` that
puts every adapter of the step in a device slot.

Three tiers: *known* (a name and a path whose config and weights were checked), *in CPU
memory* (at most ``max_cpu_loras``, least recently used dropped first and re-read from disk
when asked for again), *resident* (at most ``max_loras`` device slots). Slot 0 is "no
adapter" and stays zero. Per target module the device holds one stacked tensor per side:
A of shape (layers, max_loras + 1, max_rank, in) and B of shape (layers, max_loras + 1,
max_rank, out) (scaled, transposed), allocated when an adapter first targets that module.

Tensor parallelism (``slices``, from ``engine/parallel/shard.py``): each module's A and B are
cut as its base weight is. Column-parallel (q/k/v, gate/up): A whole, B's columns those of the
rank's outputs. Row-parallel (o_proj, down_proj): A's columns those of the rank's inputs, B
whole: the rank's ``(x_r A_rᵀ) B`` is its share of ``(x Aᵀ) B = Σ_r (x_r A_rᵀ) B``, added to its
partial output before the one all-reduce that sums both, so the delta is exact. Rank 0 decides
the slots (:meth:`activate`); a worker puts the same adapters in the same slots (:meth:`pin`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

import torch

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.lora.config import AdapterConfig, LoraError, read_adapter_config, unknown_adapter
from kvfleet.engine.lora.context import Kernel, LoraContext
from kvfleet.engine.lora.weights import LoraWeights, load_weights, module_shapes

if TYPE_CHECKING:  # the model imports this package's LoRA context: named for the type checker only
    from kvfleet.engine.model.config import ModelConfig


class LoraManager:
    def __init__(
        self,
        model: ModelConfig,
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        device: torch.device,
        dtype: torch.dtype,
        served_model: str | None = None,
        slices: Mapping[str, tuple[slice | None, slice | None]] | None = None,
    ) -> None:
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras
        self.device, self.dtype, self.served_model = device, dtype, served_model
        self._slices = dict(slices or {})  # module → (A's input columns, B's output columns) this rank holds
        self._shapes = {m: self._local(m, shape) for m, shape in module_shapes(model).items()}
        self.kernel: Kernel = "triton" if device.type == "cuda" else "torch"
        self.paths: dict[str, str] = {}
        self._configs: dict[str, AdapterConfig] = {}
        self._cpu: OrderedDict[str, LoraWeights] = OrderedDict()  # least recently used first
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident name → slot, LRU first
        self.a: dict[str, torch.Tensor] = {}  # module → (layers, max_loras + 1, max_rank, in)
        self.b: dict[str, torch.Tensor] = {}  # module → (layers, max_loras + 1, max_rank, out)
        self.loads: Counter[str] = Counter()  # into a device slot
        self.evictions: Counter[str] = Counter()  # out of a device slot
        # Called after each accepted register (name, path) and unregister (name, None): rank 0 of
        # tensor parallelism repeats them on its workers.
        self.mirror: Callable[[str, str | None], None] | None = None

    @classmethod
    def for_engine(
        cls,
        config: EngineConfig,
        model: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        slices: Mapping[str, tuple[slice | None, slice | None]] | None = None,
    ) -> LoraManager:
        """The manager ``config``'s LoRA flags ask for (each rank's: ``slices`` are its share)."""
        return cls(
            model,
            max_loras=config.max_loras,
            max_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras or config.max_loras,
            device=device,
            dtype=dtype,
            served_model=config.served_model_name or str(config.model),
            slices=slices,
        )

    # ---- known adapters
    def register(self, name: str, path: str) -> None:
        """Check the adapter's config and weights and keep it; nothing resident changes."""
        if name in self.paths:
            raise LoraError(
                "lora_name", f"an adapter named {name!r} is already loaded (from {self.paths[name]})"
            )
        if name == self.served_model:
            raise LoraError("lora_name", f"{name!r} is the base model's name; give the adapter another")
        config = read_adapter_config(path, self.max_rank, self.served_model)
        weights = load_weights(name, path, config, self.model)
        self.paths[name], self._configs[name] = path, config
        self._keep_in_cpu(weights)
        if self.mirror is not None:
            self.mirror(name, path)

    def unregister(self, name: str) -> None:
        if name not in self.paths:
            raise unknown_adapter(name)
        del self.paths[name], self._configs[name]
        self._cpu.pop(name, None)
        slot = self._slots.pop(name, None)
        if slot is not None:
            self._clear_slot(slot)
            self.evictions[name] += 1
        if self.mirror is not None:
            self.mirror(name, None)

    @property
    def resident(self) -> list[str]:
        return list(self._slots)

    @property
    def in_cpu(self) -> list[str]:
        return list(self._cpu)

    # ---- a step's adapters
    # Invariant: after activate(names), every name has a slot in 1..max_loras holding its weights,
    # at most max_loras adapters are resident, and only adapters outside names were evicted.
    def activate(self, names: Collection[str]) -> dict[str, int]:
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step with {len(names)} adapters; the scheduler allows {self.max_loras}")
        for name in names:
            if name in self._slots:
                self._slots.move_to_end(name)
            else:
                self._slots[name] = self._free_slot(names)
                self._copy_in(name, self._slots[name])
        return {name: self._slots[name] for name in names}

    def context(self, token_adapters: list[str | None]) -> LoraContext | None:
        """The step's context for one adapter name (None: the base model) per token; None if all are base."""
        names = {n for n in token_adapters if n is not None}
        if not names:
            return None
        slots = self.activate(names)
        return self.context_for_slots([0 if n is None else slots[n] for n in token_adapters])

    def context_for_slots(self, token_slots: list[int]) -> LoraContext:
        widths = {m: out for m, (_, out) in self._shapes.items()}
        return LoraContext.build(token_slots, self.a, self.b, widths, self.device, self.kernel)

    def slots_of(self, names: Collection[str]) -> dict[str, int]:
        """The device slot of each resident adapter of ``names`` (what rank 0 tells its workers)."""
        return {name: self._slots[name] for name in names}

    def pin(self, slots: Mapping[str, int]) -> None:
        """Put each adapter in the slot given (a worker following rank 0's :meth:`activate`)."""
        for name, slot in slots.items():
            if self._slots.get(name) == slot:
                continue
            self._slots.pop(name, None)
            for other, held in list(self._slots.items()):
                if held == slot:
                    del self._slots[other]
                    self.evictions[other] += 1
            self._slots[name] = slot
            self._copy_in(name, slot)

    def _free_slot(self, keep: Collection[str]) -> int:
        used = set(self._slots.values())
        free = next((s for s in range(1, self.max_loras + 1) if s not in used), None)
        if free is not None:
            return free
        victim = next(n for n in self._slots if n not in keep)  # least recently used first
        slot = self._slots.pop(victim)
        self.evictions[victim] += 1
        return slot

    def _copy_in(self, name: str, slot: int) -> None:
        weights = self._weights(name)
        self._clear_slot(slot)
        rank = weights.config.rank
        for (layer, module), a in weights.a.items():
            if module not in self.a:
                self._allocate(module)
            cols_in, cols_out = self._slices.get(module, (None, None))
            b = weights.b[(layer, module)]
            a, b = (a if cols_in is None else a[:, cols_in]), (b if cols_out is None else b[:, cols_out])
            self.a[module][layer, slot, :rank] = a.to(self.device, self.dtype)
            self.b[module][layer, slot, :rank] = b.to(self.device, self.dtype)
        self.loads[name] += 1

    def _clear_slot(self, slot: int) -> None:
        for module in self.a:
            self.a[module][:, slot].zero_()
            self.b[module][:, slot].zero_()

    def _allocate(self, module: str) -> None:
        fan_in, fan_out = self._shapes[module]
        lead = (self.model.num_layers, self.max_loras + 1, self.max_rank)
        self.a[module] = torch.zeros((*lead, fan_in), device=self.device, dtype=self.dtype)
        self.b[module] = torch.zeros((*lead, fan_out), device=self.device, dtype=self.dtype)

    def _local(self, module: str, shape: tuple[int, int]) -> tuple[int, int]:
        """(in, out) of ``module`` on this rank: the whole shape unless ``slices`` cuts a side."""
        cols_in, cols_out = self._slices.get(module, (None, None))
        fan_in = shape[0] if cols_in is None else cols_in.stop - cols_in.start
        fan_out = shape[1] if cols_out is None else cols_out.stop - cols_out.start
        return fan_in, fan_out

    # ---- the CPU tier
    def _weights(self, name: str) -> LoraWeights:
        cached = self._cpu.get(name)
        if cached is not None:
            self._cpu.move_to_end(name)
            return cached
        weights = load_weights(name, self.paths[name], self._configs[name], self.model)
        self._keep_in_cpu(weights)
        return weights

    def _keep_in_cpu(self, weights: LoraWeights) -> None:
        self._cpu[weights.name] = weights
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)
