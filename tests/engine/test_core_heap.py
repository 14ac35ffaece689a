"""The core process freezes its start-up heap: a full collection no longer walks torch and the model."""

from __future__ import annotations

import gc
import weakref

from kvfleet.engine.core.loop import freeze_startup_heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_up_objects_leave_the_collector_and_later_cycles_are_still_collected() -> None:
    alive = Cycle()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert all(o is not alive for o in gc.get_objects())  # frozen: no collection walks it again
        later = Cycle()
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None  # garbage made after start-up is still found
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
