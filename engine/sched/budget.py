"""Step budgets, registered by name: how much one engine step may compute, and in which order.

Where it sits: ``Scheduler`` (engine/sched/scheduler.py) holds one :class:`Budget`, chosen by name
(``tokens`` or ``time``, as policies are in engine/sched/policy.py), and opens a :class:`StepBudget`
on it at the start of every ``Scheduler.schedule()``. Its one planning loop asks the step budget
for the order in which to serve the running sequences, how many tokens each chunk may have
(:meth:`StepBudget.grant`, 0: the step is full), and tells it what was planned
(:meth:`StepBudget.spend`). The budget never allocates blocks and never preempts; pure Python.

- ``tokens``: ``max_num_batched_tokens`` per step; running sequences in policy order.
- ``time`` (stall-free, Sarathi-Serve): running decodes first, then prefill chunks sized so the
  step's predicted time (``step_cost.StepCostModel``) stays within ``max(target_step_s,
  decode_factor × the decode step midway to the batch the prompts make)``
  (``step_cost.StepTimeBudget``); the token cap still bounds every step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.engine.sched.plan import ScheduledSeq
from kvfleet.engine.sched.step_cost import StepCostModel, StepShape, StepTimeBudget
from kvfleet.engine.sequence import Sequence, SequenceStatus

# Under a step time target, the first prefill of every step gets at least this many tokens, so
# prompts progress even when the running decodes alone fill the target.
MIN_PREFILL_CHUNK_TOKENS = 32
_RUNNING = SequenceStatus.RUNNING


@dataclass(frozen=True)
class BudgetLimits:
    """What a budget is built from: the engine's caps and, for the time budget, its step bound."""

    max_num_batched_tokens: int
    max_num_seqs: int
    target_step_s: float | None = None  # a step may always take this long; None: no floor
    decode_factor: float | None = None  # a step may take this many decode-only steps; None: no scaling
    step_cost: StepCostModel = field(default_factory=StepCostModel)
    min_prefill_chunk: int = MIN_PREFILL_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if self.target_step_s is not None and self.target_step_s <= 0:
            raise ValueError(f"target_step_s must be > 0, got {self.target_step_s}")
        if self.decode_factor is not None and self.decode_factor <= 1.0:
            # prefill gets factor - 1 decode steps
            raise ValueError(f"decode_factor must be > 1, got {self.decode_factor}")

    @property
    def bounds_time(self) -> bool:
        """Whether a step time bound is given (a target, a decode factor or both)."""
        return self.target_step_s is not None or self.decode_factor is not None


class StepBudget:
    """One step's token cap, spent as the plan grows; the base of every step budget."""

    def __init__(self, tokens: int, order: list[Sequence]) -> None:
        self.tokens_left = tokens
        self.order = order  # the running sequences, in the order the step serves them

    def grant(self, seq: Sequence, computed: int, wanted: int, *, whole: bool = False) -> int:
        """Tokens of ``seq``'s next chunk (it has ``computed``, wants ``wanted`` more) this step may
        compute; 0: none, the step is full. ``whole``: a prompt that is not chunked, not cut by the cap."""
        left = self.tokens_left  # called per running sequence per step: no min(), no super()
        return wanted if whole or wanted <= left else left

    def spend(self, seq: Sequence, computed: int, num_new: int) -> None:
        """``num_new`` tokens of ``seq`` (from ``computed``) are in the plan."""
        left = self.tokens_left - num_new
        self.tokens_left = left if left > 0 else 0


class Budget(ABC):
    """How much one step may compute, and in which order its running sequences are served; one
    instance per scheduler, built from :class:`BudgetLimits` by its registered name."""

    name: str
    learns_step_cost = False  # whether Engine.step() feeds limits.step_cost the steps' seconds

    def __init__(self, limits: BudgetLimits) -> None:
        self.limits = limits

    @abstractmethod
    def open(
        self, running: list[Sequence], waiting: deque[Sequence], scheduled: list[ScheduledSeq]
    ) -> StepBudget:
        """The budget of the step being planned: ``running`` in policy order, ``scheduled`` the plan
        as it grows (read, never written, by the step budget)."""


class TokenBudget(Budget):
    """The ``tokens`` budget: every step computes at most ``max_num_batched_tokens``, running
    sequences served in policy order."""

    name = "tokens"

    def __init__(self, limits: BudgetLimits) -> None:
        if limits.bounds_time:
            raise ValueError(
                "step budget 'tokens' bounds tokens only: target_step_s and decode_factor need 'time'"
            )
        super().__init__(limits)

    def open(
        self, running: list[Sequence], waiting: deque[Sequence], scheduled: list[ScheduledSeq]
    ) -> StepBudget:
        return StepBudget(self.limits.max_num_batched_tokens, list(running))


class TimeStepBudget(StepBudget):
    """One stall-free step: decodes first under the cap alone, then prefill chunks (running
    prompts, then admissions) sized by the :class:`StepTimeBudget` opened on the decodes planned,
    when there are any (no decode: no stream to protect, the cap alone bounds the step)."""

    def __init__(
        self,
        limits: BudgetLimits,
        running: list[Sequence],
        waiting: deque[Sequence],
        plan: list[ScheduledSeq],
    ) -> None:
        decodes = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        self._prefilling = [s for s in running if s.num_tokens - s.num_computed_tokens > 1]
        super().__init__(limits.max_num_batched_tokens, decodes + self._prefilling)
        self._limits, self._waiting, self._plan = limits, waiting, plan
        self._time: StepTimeBudget | None = None
        self._opened = False

    def _open(self) -> StepTimeBudget | None:
        """The time bound, opened once, at the first prefill chunk: every decode is planned by then."""
        if not self._opened:
            self._opened = True
            if self._plan:
                lim = self._limits
                shape = StepShape.of(self._plan)
                full = shape.joined_by(lim.max_num_seqs, self._prefilling, self._waiting)
                self._time = StepTimeBudget(
                    lim.step_cost,
                    lim.target_step_s or 0.0,
                    lim.min_prefill_chunk,
                    shape,
                    lim.decode_factor or 0.0,
                    full,
                )
        return self._time

    def grant(self, seq: Sequence, computed: int, wanted: int, *, whole: bool = False) -> int:
        left = self.tokens_left
        num_new = wanted if whole or wanted <= left else left
        if num_new == 0:
            return 0
        if (
            not self._opened
            and wanted == 1
            and seq.status is _RUNNING
            and computed == seq.num_computed_tokens
        ):
            return 1  # a decode: the running sequence's one token left (no cached prefix), the cap alone
        time = self._open()
        return num_new if time is None else time.chunk(computed, num_new)

    def spend(self, seq: Sequence, computed: int, num_new: int) -> None:
        left = self.tokens_left - num_new
        self.tokens_left = left if left > 0 else 0
        if self._time is not None:  # opened at the first prefill chunk: every spend since is one
            self._time.spend(computed, num_new)


class TimeBudget(Budget):
    """The ``time`` budget (stall-free): see :class:`TimeStepBudget` and ``step_cost.StepTimeBudget``."""

    name = "time"
    learns_step_cost = True

    def __init__(self, limits: BudgetLimits) -> None:
        if not limits.bounds_time:
            raise ValueError("step budget 'time' needs target_step_s, decode_factor or both")
        super().__init__(limits)

    def open(
        self, running: list[Sequence], waiting: deque[Sequence], scheduled: list[ScheduledSeq]
    ) -> StepBudget:
        return TimeStepBudget(self.limits, running, waiting, scheduled)


_BUDGETS: dict[str, Callable[[BudgetLimits], Budget]] = {}


def register_budget(name: str, factory: Callable[[BudgetLimits], Budget]) -> None:
    _BUDGETS[name] = factory


def budget_names() -> list[str]:
    return sorted(_BUDGETS)


def make_budget(name: str, limits: BudgetLimits) -> Budget:
    try:
        factory = _BUDGETS[name]
    except KeyError:
        raise ValueError(
            f"step budget: unknown budget {name!r}; known: {', '.join(budget_names())}"
        ) from None
    return factory(limits)


def default_budget_name(limits: BudgetLimits) -> str:
    """``time`` when a step time bound is given, else ``tokens``."""
    return TimeBudget.name if limits.bounds_time else TokenBudget.name


register_budget(TokenBudget.name, TokenBudget)
register_budget(TimeBudget.name, TimeBudget)
