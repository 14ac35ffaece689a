"""Scheduling policies, registered by name: the order of the queues and who may be admitted.

Where it sits: ``Scheduler`` (mechanism: budgets, blocks, preemption) asks its
:class:`SchedulingPolicy` (``EngineConfig.scheduling_policy``) how to order the waiting
and running sequences and whether it may admit new ones this step. The most important
sequence sorts first; the preemption victim is the last running sequence in that order.

- ``fcfs``: arrival order; a preempted sequence goes back to the front of the queue.
- ``priority``: lower ``priority`` value first, then arrival order.
- ``static``: FCFS, but new sequences are admitted only when nothing is running, all at
  once up to ``max_num_seqs`` (classic static batching, for benchmarks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvfleet.engine.sequence import Sequence


class SchedulingPolicy:
    """FCFS: the base policy; subclasses override the order key or the admission rule."""

    name = "fcfs"
    # Static batching admits a whole batch when idle, whether or not this step's token
    # budget can start each of them.
    admits_whole_batch = False

    def key(self, seq: Sequence) -> tuple[float, ...]:
        """Sort key: smaller = more important."""
        return (seq.arrival_time, seq.seq_id)

    def order_waiting(self, waiting: deque[Sequence]) -> None:
        """Reorder the waiting queue in place; FCFS keeps insertion order (preempted at the front)."""

    def order_running(self, running: list[Sequence]) -> None:
        running.sort(key=self.key)

    def may_admit(self, num_running: int) -> bool:
        return True


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def key(self, seq: Sequence) -> tuple[float, ...]:
        return (seq.priority, seq.arrival_time, seq.seq_id)

    def order_waiting(self, waiting: deque[Sequence]) -> None:
        ordered = sorted(waiting, key=self.key)
        waiting.clear()
        waiting.extend(ordered)


class StaticBatchPolicy(SchedulingPolicy):
    name = "static"
    admits_whole_batch = True

    def may_admit(self, num_running: int) -> bool:
        return num_running == 0


_POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {}


def register_policy(name: str, factory: Callable[[], SchedulingPolicy]) -> None:
    _POLICIES[name] = factory


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"scheduling_policy: unknown policy {name!r}; known: {', '.join(policy_names())}"
        ) from None


register_policy("fcfs", SchedulingPolicy)
register_policy("priority", PriorityPolicy)
register_policy("static", StaticBatchPolicy)
