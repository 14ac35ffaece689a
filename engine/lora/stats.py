"""What the engine reports about its adapters, and what it needs of whoever holds them. Torch-free.

Where it sits: ``Engine`` (torch-free) keeps a :class:`LoraUsage` (per-adapter requests and
tokens) and reads the runner's adapter holder (``LoraManager``, torch) for the rest; ``Engine.stats()`` puts a :class:`LoraStats` in every ``EngineStats``,
which ``GET /load`` (``kvfleet.protocol.LoraLoad``) and ``/metrics`` (``vllm:lora_requests_info``,
``kvfleet:lora_*``) read in the API process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the manager holds tensors; the torch-free engine names it for the type checker only
    from kvfleet.engine.lora.manager import LoraManager


@dataclass(frozen=True)
class LoraStats:
    max_loras: int
    known: dict[str, str]  # adapter → path
    resident: tuple[str, ...]
    running: tuple[str, ...]  # adapters of running sequences, each once
    waiting: tuple[str, ...]  # adapters of waiting sequences, each once
    requests: dict[str, int] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    generation_tokens: dict[str, int] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)


@dataclass
class LoraUsage:
    """Per-adapter counters the engine loop bumps (requests on arrival, tokens as they are sampled)."""

    requests: Counter[str] = field(default_factory=Counter)
    prompt_tokens: Counter[str] = field(default_factory=Counter)
    generation_tokens: Counter[str] = field(default_factory=Counter)

    def snapshot(
        self, host: LoraManager, running: Iterable[str | None], waiting: Iterable[str | None]
    ) -> LoraStats:
        return LoraStats(
            max_loras=host.max_loras,
            known=dict(host.paths),
            resident=tuple(host.resident),
            running=_distinct(running),
            waiting=_distinct(waiting),
            requests=dict(self.requests),
            prompt_tokens=dict(self.prompt_tokens),
            generation_tokens=dict(self.generation_tokens),
            loads=_plain(host.loads),
            evictions=_plain(host.evictions),
        )


def _distinct(names: Iterable[str | None]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for n in names if n is not None))


def _plain(counts: Mapping[str, int]) -> dict[str, int]:
    return {k: int(v) for k, v in counts.items()}
