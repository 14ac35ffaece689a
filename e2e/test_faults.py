"""Faults in the fleet, under a bounded load from three tenants: nothing accepted is ever lost.

Real processes throughout (:mod:`kvfleet.testing.faults`): ``kvfleet up --simulate`` for the
faults its supervisor heals, simulated engines with two ``kvfleet router`` replicas on one
real ``redis-server`` for the rest. Every request of the load ends completed, refused before
it was sent, or with a clean OpenAI error (a status and error body, or an SSE error event
then ``[DONE]``); ``lost`` (a hang, a truncated stream that looks finished, another error
shape, a broken connection with no terminal event) must be 0, and every quota charge is
settled afterwards. ``bench/router/faults.py`` runs the same scenarios and prints their table.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.testing import fault_scenarios as scenarios
from kvfleet.testing.faults import LocalUp, StaticFleet, local_up, static_fleet


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalUp]:
    with local_up(Path(tmp_path_factory.mktemp("up"))) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StaticFleet]:
    with static_fleet(Path(tmp_path_factory.mktemp("static"))) as f:
        yield f


def _nothing_lost(run: scenarios.FaultRun, errors: set[str] | None = None) -> None:
    print(f"\n{scenarios.HEADER}\n{run.row()}\n{run.facts}")
    assert run.tally.lost == [], "\n".join(map(str, run.tally.lost))
    assert run.held == (0.0, 0.0), f"quota still held after the load (requests, tokens): {run.held}"
    assert set(run.tally.error_codes()) <= (errors or set()), run.tally.error_codes()


def test_an_engine_killed_mid_stream_fails_its_streams_cleanly_and_is_replaced(up: LocalUp) -> None:
    run = scenarios.engine_sigkill(up)
    _nothing_lost(run, {"engine_failed", "no_ready_engine", "engine_unreachable"})
    assert run.tally.count("completed") > 0 and run.tally.count("refused") == 0
    assert "its process ended (killed by SIGKILL)" in up.log_text()


def test_a_client_that_never_reads_is_cut_off_and_settled_while_other_streams_complete(up: LocalUp) -> None:
    run = scenarios.slow_client(up)
    _nothing_lost(run)
    assert run.tally.count("completed") == len(run.tally.outcomes), "the other streams complete"
    assert run.facts["first_bytes"] == "HTTP/1.1 200 OK | HTTP/1.1 200 OK"
    assert run.facts["stalls_logged"] >= 2, "both the router and the engine cut an unread stream off"


def test_a_rolling_restart_of_every_engine_fails_no_request(up: LocalUp) -> None:
    run = scenarios.rolling_restart(up)
    _nothing_lost(run)
    assert run.tally.count("completed") == len(run.tally.outcomes), run.tally.error_codes()
    assert run.facts["replaced"] == 2


def test_the_local_fleet_restarted_under_load_finishes_its_streams_and_serves_again(up: LocalUp) -> None:
    run = scenarios.local_restart(up)
    _nothing_lost(run)
    assert run.tally.count("completed") == run.tally.accepted, (
        "in-flight requests finish as the router drains"
    )


def test_a_hung_engine_times_out_cleanly_is_taken_out_and_comes_back(fleet: StaticFleet) -> None:
    run = scenarios.engine_sigstop(fleet)
    _nothing_lost(run, {"engine_timeout", "engine_failed"})
    assert run.facts["leases"] == 0, "every concurrency slot is back in Redis"


def test_a_router_replica_restarted_under_load_loses_nothing_and_counts_quota_once(
    fleet: StaticFleet,
) -> None:
    run = scenarios.router_restart(fleet)
    _nothing_lost(run)
    assert run.tally.count("completed") == run.tally.accepted, (
        "in-flight requests finish as the router drains"
    )
    assert run.facts["leases"] == 0


def test_with_redis_gone_the_routers_fail_closed_and_recover_by_themselves(fleet: StaticFleet) -> None:
    run = scenarios.redis_restart(fleet)
    _nothing_lost(run, {"quota_store_unavailable"})
    assert run.tally.error_codes().get("quota_store_unavailable", 0) > 0, "fail closed while Redis is gone"
    assert run.facts["leases"] == 0
