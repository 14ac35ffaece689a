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
* ``precise-prefix``: ``default``, its prefix term read from the engines' own KV events
  (:mod:`.kv_index`: the longest prefix of the prompt's tokens, hashed as each engine hashes, that it
  holds; blocks only in a host tier count half); an engine not followed, or whose events stopped
  while it is busy, gets today's estimate. The fleet computes that term only for this policy, so
  ``default`` takes it too wherever it is given (``Candidate.precise_prefix``).
* ``adapter-aware``: the default when a request names a LoRA adapter (docs/architecture.md §6).
  Within the same load bound: first the engines that hold the adapter (resident, or sent it
  since their last load), scored as ``default`` among themselves; else the least-loaded
  engine with a free adapter slot (fewer resident than ``max_loras``, or an idle resident one
  to evict); else, every slot busy, the least-loaded engine.
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
    adapter: str | None = None  # the LoRA adapter the request names
    adapters_sent: frozenset[str] = frozenset()  # adapters placed here since the load was read
    # the prompt's share the engine's KV events say it holds (router/kv_index.py); None: not known
    precise_prefix: float | None = None

    def holds_adapter(self) -> bool:
        """The adapter is on the engine or on its way there: resident, asked for, or just sent."""
        lora, adapter = self.load.lora, self.adapter
        if adapter is None or lora is None:
            return False
        return adapter in self.adapters_sent or adapter in {*lora.resident, *lora.running, *lora.waiting}

    def has_adapter_slot(self) -> bool:
        """Loading the adapter would not wait: a slot is free, or a resident adapter is idle (LRU victim)."""
        lora = self.load.lora
        if lora is None:
            return False
        held = {*lora.resident, *self.adapters_sent}
        busy = {*lora.running, *lora.waiting, *self.adapters_sent}
        return len(held) < lora.max_loras or any(a not in busy for a in lora.resident)

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
    """What the engine's KV events say it holds where they are followed, else the router's own record."""
    if c.precise_prefix is not None:
        return c.precise_prefix
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


def adapter_score(c: Candidate, ctx: PickContext) -> float:
    # Invariant: tiers never overlap: holding the adapter scores in [4, 5], a free slot in [2, 3],
    # neither in [0, 1]; within a tier, cache affinity (holders) or the lighter load (the rest) wins.
    if c.holds_adapter():
        return 4.0 + default_score(c, ctx)
    return (2.0 if c.has_adapter_slot() else 0.0) + load_score(c, ctx)


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
        Policy("precise-prefix", default_score, admit=within_bound),
        Policy("adapter-aware", adapter_score, admit=within_bound),
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
