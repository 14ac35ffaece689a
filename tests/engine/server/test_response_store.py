"""The engine's store of responses (``store: true``): bounded in number, each kept for its TTL."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from kvfleet.engine import cli
from kvfleet.engine.server.response_store import ResponseStore, store_from_args


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _store(max_entries: int = 3, ttl_s: float = 10.0) -> tuple[ResponseStore, Clock]:
    clock = Clock()
    return ResponseStore(max_entries, ttl_s, clock), clock


def test_a_response_is_kept_until_its_ttl_passes() -> None:
    store, clock = _store()
    store.put("a", {"id": "a"}, [{"role": "user", "content": "hi"}])
    clock.now += 9.9
    stored = store.get("a")
    assert stored is not None and stored.history == [{"role": "user", "content": "hi"}]
    clock.now += 0.1
    assert store.get("a") is None
    assert len(store) == 0


def test_past_the_bound_the_oldest_response_is_evicted_first() -> None:
    store, clock = _store(max_entries=2)
    for name in "abc":
        store.put(name, {"id": name}, [])
        clock.now += 1
    assert (store.get("a"), len(store)) == (None, 2)
    assert store.get("b") is not None and store.get("c") is not None


def test_storing_an_id_again_replaces_it_and_renews_its_ttl() -> None:
    store, clock = _store(ttl_s=5)
    store.put("a", {"v": 1}, [])
    clock.now += 4
    store.put("a", {"v": 2}, [])
    clock.now += 4
    stored = store.get("a")
    assert stored is not None and stored.response == {"v": 2}


def test_deleting_removes_a_response_once() -> None:
    store, _ = _store()
    store.put("a", {}, [])
    assert (store.delete("a"), store.delete("a"), store.get("a")) == (True, False, None)


async def test_evicting_a_running_background_response_cancels_its_task() -> None:
    store, _ = _store(max_entries=1)
    stored = store.put("a", {}, [])
    stored.task = asyncio.create_task(asyncio.sleep(60))
    store.put("b", {}, [])
    with pytest.raises(asyncio.CancelledError):
        await stored.task


@pytest.mark.parametrize(("max_entries", "ttl_s"), [(0, 10.0), (5, 0.0)])
def test_a_store_without_room_or_time_is_refused(max_entries: int, ttl_s: float) -> None:
    with pytest.raises(ValueError, match="max_entries >= 1 and ttl_s > 0"):
        ResponseStore(max_entries, ttl_s)


def test_the_engine_refuses_a_store_flag_without_room_naming_both_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--simulate", "--responses-store-max", "0"])
    assert cli.run(args) == 2
    assert (
        "need --responses-store-max >= 1 and --responses-store-ttl > 0, got 0 and 3600.0"
        in capsys.readouterr().err
    )


def test_the_engine_flags_size_the_store() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    store = store_from_args(parser.parse_args(["--responses-store-max", "7", "--responses-store-ttl", "60"]))
    assert (store.max_entries, store.ttl_s) == (7, 60.0)
