"""Picking an engine, step four of the request path (docs/architecture.md §6).

Candidates are the ready, non-draining engines of a model whose load is fresh. Each
policy gives every candidate a score (higher is better); the best wins, ties going to
the less busy engine, then to the next one in round-robin order, so equal engines
share work. Policies register by name in :data:`POLICIES`:

* ``round-robin``: rotation order only;
* ``least-request``: fewest requests in flight (router's count or the engine's
  running + waiting, whichever is larger);
* ``kv-aware``: lowest KV-cache usage (reported, plus the tokens sent since the report);
* ``prefix-aware``: most leading prompt blocks already sent there (:mod:`.prefix`);
* ``default``: cache affinity under a load bound. Engines busier than the bound of
  bounded-load consistent hashing (Mirrokni et al., 2018: ``ceil((1+ε)·(Σbusy+1)/n)``,
  plus a slack of a few requests) are set aside; the rest are scored by the weighted mix
  ``(w_prefix·prefix + w_kv·kv + w_load·load + w_room·room + w_backlog·backlog) / Σw``,
  where *room* is how few distinct prompt starts the engine was sent (a cold prompt goes
  where it evicts the least, as SGLang's cache-aware router sends it to the smallest
  tree) and *backlog* how few uncached prompt tokens it is still prefilling (the fleet's
  estimate, see :meth:`.fleet.Fleet.backlog`: a cold prompt avoids an engine still busy
  with another, whatever its request count). With the prefix
  weight dominant, a request follows its cached prefix until that engine is over the
  bound, then spills to the best other one, which thereby becomes a second home.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

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
    prompt_starts: int = 0  # distinct prompt starts (first block hashes) sent to it lately
    prefill_tokens: int = 0  # uncached prompt tokens sent to it whose first byte is not back yet

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
    max_prompt_starts: int = 0  # the most any candidate has (room's scale)
    max_prefill_tokens: int = 0  # the most any candidate has (backlog's scale)


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


def room_score(c: Candidate, ctx: PickContext) -> float:
    return 1.0 - c.prompt_starts / ctx.max_prompt_starts if ctx.max_prompt_starts else 1.0


def backlog_score(c: Candidate, ctx: PickContext) -> float:
    return 1.0 - c.prefill_tokens / ctx.max_prefill_tokens if ctx.max_prefill_tokens else 1.0


def default_score(c: Candidate, ctx: PickContext) -> float:
    w = ctx.weights
    total = w.prefix + w.kv + w.load + w.room + w.backlog
    mixed = w.prefix * prefix_score(c, ctx) + w.kv * kv_score(c, ctx) + w.load * load_score(c, ctx)
    mixed += w.room * room_score(c, ctx) + w.backlog * backlog_score(c, ctx)
    return mixed / total if total else 0.0


def load_bound(cands: Sequence[Candidate], ctx: PickContext) -> int:
    """The most requests an engine may hold after taking this one (bounded-load hashing, plus slack)."""
    total = sum(c.busy for c in cands) + 1
    return math.ceil((1.0 + ctx.weights.balance_factor) * total / len(cands)) + ctx.weights.balance_slack


def within_bound(cands: Sequence[Candidate], ctx: PickContext) -> list[Candidate]:
    # Invariant: keeps exactly the candidates with busy + 1 <= load_bound, never none: the least
    # busy engine is at most the mean, and the bound is at least the mean plus one.
    bound = load_bound(cands, ctx)
    return [c for c in cands if c.busy + 1 <= bound]


Score = Callable[[Candidate, PickContext], float]
Admit = Callable[[Sequence[Candidate], PickContext], list[Candidate]]


@dataclass(frozen=True)
class Policy:
    """A named score over the candidates ``admit`` keeps; ``tie_by_busy`` False leaves ties to the rotation."""

    name: str
    score: Score
    tie_by_busy: bool = True
    admit: Admit | None = None


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("round-robin", lambda c, ctx: 0.0, tie_by_busy=False),
        Policy("least-request", lambda c, ctx: float(-c.busy)),
        Policy("kv-aware", kv_score),
        Policy("prefix-aware", prefix_score),
        Policy("default", default_score, admit=within_bound),
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
    # Invariant: among the candidates ``admit`` keeps (all without it), the result maximises
    # (score, -busy) (just score without tie_by_busy); among exact
    # ties the first candidate at or after position ``rotation`` (mod n) wins, so successive
    # rotations spread equal engines evenly.
    if not cands:
        return None
    ctx = replace(
        ctx,
        max_prompt_starts=max(c.prompt_starts for c in cands),
        max_prefill_tokens=max(c.prefill_tokens for c in cands),
    )
    if pol.admit is not None:
        cands = pol.admit(cands, ctx)
    n = len(cands)
    ordered = [cands[(rotation + i) % n] for i in range(n)]
    best = max(ordered, key=lambda c: (pol.score(c, ctx), -c.busy if pol.tie_by_busy else 0))
    return Choice(best.url, pol.score(best, ctx))
