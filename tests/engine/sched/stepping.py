"""Drive a scheduler by hand, as ``Engine.step()`` does, for the scheduler tests of this folder.

Every step samples token 7 for each entry that samples, so plans depend only on the scheduler.
"""

from __future__ import annotations

from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sched.plan import SchedulerPlan
from kvfleet.engine.sched.scheduler import Scheduler


def step(s: Scheduler) -> SchedulerPlan:
    """Plan one step and feed back token 7 for every entry that samples."""
    plan = s.schedule()
    s.update(plan, {e.seq.seq_id: SampleResult(7) for e in plan.scheduled if e.sample})
    return plan


def summary(plan: SchedulerPlan) -> list[tuple[str, int, int]]:
    """Each entry of the plan as (request id, tokens computed before, tokens computed now)."""
    return [(e.seq.request_id, e.num_computed_before, e.num_new_tokens) for e in plan.scheduled]
