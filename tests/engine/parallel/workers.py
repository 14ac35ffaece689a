"""The check every tensor-parallel ``LLM`` test makes: the workers really ran (no silent fallback to tp=1).

Where it sits: test support beside :mod:`.compare`. A tp=2 run whose tokens equal tp=1's proves
nothing if it quietly ran in one process, so each tp>1 ``LLM`` is checked, before it closes,
for a leader with ``tp - 1`` live worker processes (running ``kvfleet.engine.parallel.worker``),
the model's collectives being the leader's over ``tp`` ranks, and all-reduces that completed:
an all-reduce returns only once every rank has joined it, so a completed one is work done on
each worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvfleet.engine import LLM, SamplingParams

WORKER_MODULE = "kvfleet.engine.parallel.worker"


def assert_workers_ran(llm: LLM, tp: int) -> None:
    """``llm`` (still open, after at least one generate) ran over ``tp`` ranks; tp=1: in one process."""
    runner = llm.engine.runner
    if tp == 1:
        assert runner.leader is None, "tensor_parallel_size=1 started workers"
        return
    leader = runner.leader
    assert leader is not None, f"tensor_parallel_size={tp} ran in one process: no leader, no workers"
    assert leader.comm.world_size == tp and runner.model.comm is leader.comm
    assert len(leader.procs) == tp - 1
    for proc in leader.procs:
        assert proc.poll() is None, f"worker pid {proc.pid} exited (code {proc.returncode})"
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert WORKER_MODULE.encode() in cmdline, f"pid {proc.pid} is not a worker: {cmdline}"
    assert leader.comm.reduces > 0, "no all-reduce ran: the workers never stepped with rank 0"


def first_token_agreement(
    make: Callable[[int], LLM],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    check: Callable[[LLM], None] | None = None,
) -> float:
    """The share of ``prompts`` whose first greedy token the engine ``make(2)`` gives as ``make(1)``
    does: each engine ``check``ed (its weight format) and :func:`assert_workers_ran`, then closed."""

    def first_tokens(tp: int) -> list[int]:
        llm = make(tp)
        try:
            if check is not None:
                check(llm)
            outs = llm.generate([list(p) for p in prompts], params)
            assert_workers_ran(llm, tp)
            return [o.outputs[0].token_ids[0] for o in outs]
        finally:
            llm.close()

    one, two = first_tokens(1), first_tokens(2)
    return sum(a == b for a, b in zip(one, two, strict=True)) / len(one)
