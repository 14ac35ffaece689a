"""Picking an engine, step four of the request path (DESIGN §6).

Candidates are the ready, non-draining engines of a model whose load is fresh. Each
policy gives every candidate a score (higher is better); the best wins, ties going to
the less busy engine, then to the next one in round-robin order, so equal engines
share work. Policies register by name in :data:`POLICIES`:

* ``round-robin``: rotation order only;
* ``least-request``: fewest requests in flight (router's count or the engine's
  running + waiting, whichever is larger);
* ``kv-aware``: lowest KV-cache usage (reported, plus the tokens sent since the report);
* ``prefix-aware``: most leading prompt blocks already sent there (:mod:`.prefix`);
* ``default``: ``(w_prefix·prefix + w_kv·kv + w_load·load) / Σw``, the weighted mix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvfleet.protocol import EngineLoad
from kvfleet.router.config import PickerWeights


@dataclass(frozen=True)
class Candidate:
    """One engine as the picker sees it at this instant."""

    url: str
    load: EngineLoad
    in_flight: int
    prefix_blocks: int = 0
    prompt_blocks: int = 0
    pending_tokens: int = 0

    @property
    def busy(self) -> int:
        return max(self.in_flight, self.load.num_running + self.load.num_waiting)

    @property
    def kv_usage(self) -> float:
        """The last reported usage plus what the router sent since: loads are ~200 ms old, and
        without this every request in between would herd onto the same least-used engine."""
        capacity = self.load.num_kv_blocks * self.load.block_size
        pending = self.pending_tokens / capacity if capacity else 0.0
        return min(1.0, self.load.kv_cache_usage + pending)


@dataclass(frozen=True)
class PickContext:
    weights: PickerWeights
    max_engine_queue: int
    saturation_kv_usage: float


def is_saturated(c: Candidate, ctx: PickContext) -> bool:
    """Full: its queue is past ``max_engine_queue``, or its KV cache is full with requests waiting."""
    if c.busy >= c.load.max_num_seqs + ctx.max_engine_queue:
        return True
    return c.load.kv_cache_usage >= ctx.saturation_kv_usage and c.load.num_waiting > 0


def kv_score(c: Candidate, ctx: PickContext) -> float:
    return 1.0 - c.kv_usage


def load_score(c: Candidate, ctx: PickContext) -> float:
    return 1.0 - min(1.0, c.busy / (c.load.max_num_seqs + ctx.max_engine_queue))


def prefix_score(c: Candidate, ctx: PickContext) -> float:
    return c.prefix_blocks / c.prompt_blocks if c.prompt_blocks else 0.0


def default_score(c: Candidate, ctx: PickContext) -> float:
    w = ctx.weights
    total = w.prefix + w.kv + w.load
    mixed = w.prefix * prefix_score(c, ctx) + w.kv * kv_score(c, ctx) + w.load * load_score(c, ctx)
    return mixed / total if total else 0.0


Score = Callable[[Candidate, PickContext], float]


@dataclass(frozen=True)
class Policy:
    """A named score; ``tie_by_busy`` False leaves ties to the rotation alone."""

    name: str
    score: Score
    tie_by_busy: bool = True


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("round-robin", lambda c, ctx: 0.0, tie_by_busy=False),
        Policy("least-request", lambda c, ctx: float(-c.busy)),
        Policy("kv-aware", kv_score),
        Policy("prefix-aware", prefix_score),
        Policy("default", default_score),
    )
}


def policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


@dataclass(frozen=True)
class Choice:
    url: str
    score: float


def choose(cands: Sequence[Candidate], pol: Policy, ctx: PickContext, rotation: int) -> Choice | None:
    # Invariant: the result maximises (score, -busy) (just score without tie_by_busy); among exact
    # ties the first candidate at or after position ``rotation`` (mod n) wins, so successive
    # rotations spread equal engines evenly.
    if not cands:
        return None
    n = len(cands)
    ordered = [cands[(rotation + i) % n] for i in range(n)]
    best = max(ordered, key=lambda c: (pol.score(c, ctx), -c.busy if pol.tie_by_busy else 0))
    return Choice(best.url, pol.score(best, ctx))
