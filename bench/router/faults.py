"""Faults in the fleet: what each one cost a multi-tenant load, and how long the fleet took to heal.

The scenarios of ``e2e/test_faults.py`` (:mod:`kvfleet.testing.fault_scenarios`), run once each
and printed as one table: ``kvfleet up --simulate`` (two engines, its router in-process) for an
engine SIGKILLed mid-stream, a client that never reads its stream, a rolling restart, and
``kvfleet up`` itself restarted (SIGTERM: its router drains, then its engines; memory quotas); two
simulated engines behind two ``kvfleet router`` replicas on one ``redis-server`` for a hung
engine (SIGSTOP, SIGCONT after 5 s), a router replica restarted, and Redis stopped for 2 s.
Three tenants, six clients (closed loop), 40-token streams. Counts: accepted (the server
answered), completed, clean errors (an OpenAI error body or SSE error event; by code on the
right), refused (connection refused while a router was down: never accepted), lost (must be
0). ``heal s``: seconds from the fault (from SIGCONT for the hung engine, from Redis's restart,
from the router's restart) until the fleet served as before; for the client that never
reads, until its stream was cut off and its quota settled (the bound is 2 s of no progress
after 16 KiB send buffers fill); for the rolling restart, the whole roll.
Run: ``.venv/bin/python -m bench.router.faults``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import publish
from bench.router.router_fleet import header
from kvfleet.testing import fault_scenarios as scenarios
from kvfleet.testing.faults import local_up, static_fleet


def main() -> None:
    runs: list[scenarios.FaultRun] = []
    with tempfile.TemporaryDirectory() as tmp:
        with local_up(Path(tmp)) as up:
            runs += [scenarios.engine_sigkill(up), scenarios.slow_client(up), scenarios.rolling_restart(up)]
            runs.append(scenarios.local_restart(up))
        with static_fleet(Path(tmp)) as fleet:
            runs += [
                scenarios.engine_sigstop(fleet),
                scenarios.router_restart(fleet),
                scenarios.redis_restart(fleet),
            ]
    lines = [header("faults in the fleet under a 3-tenant streaming load"), scenarios.HEADER]
    lines += [run.row() for run in runs]
    lines.append("")
    lines += [f"{run.fault}: quota held after (requests, tokens) {run.held}; {run.facts}" for run in runs]
    publish(lines, "faults.txt")


if __name__ == "__main__":
    main()
