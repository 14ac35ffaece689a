"""The core process's wire format: a StepBatch crosses the pipe as plain tuples and comes back equal."""

from __future__ import annotations

import pickle

from kvfleet.engine.core.messages import StepBatch, Verdict, from_wire, to_wire
from kvfleet.engine.outputs import EngineStats, ReqDelta, SeqDelta, TokenLogprob


def test_a_step_batch_survives_the_pipe_field_for_field_with_its_named_types() -> None:
    stats = EngineStats(2, 1, 0.25, 64, 8, 3, 1, 0, 40, 7, 1)
    logprobs = [TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.25)))]
    batch = StepBatch(
        12.5,
        12.25,
        [Verdict("a"), Verdict("b", "max_tokens must be at least 1, got 0", "max_tokens")],
        [
            ReqDelta("a", False, 4, 0, [SeqDelta(0, "x", [5], None, None, logprobs)]),
            ReqDelta("c", True, 9, 8, [SeqDelta(0, "", [], "stop", 2, None), SeqDelta(1, "yz", [6, 7], "length", None, None)]),
        ],
        stats,
    )  # fmt: skip
    wire = to_wire(batch)
    assert type(wire[3][0]) is tuple and type(wire[3][0][4][0]) is tuple  # plain tuples on the pipe
    back = from_wire(pickle.loads(pickle.dumps(wire)))
    assert back == batch
    assert back.deltas[1].seqs[1].new_token_ids == [6, 7]
    assert back.verdicts[1].field == "max_tokens"
    assert back.deltas[0].seqs[0].new_logprobs == logprobs


def test_the_dead_core_batch_keeps_its_error_across_the_pipe() -> None:
    dead = StepBatch(1.0, None, [], [], None, "the engine loop failed: RuntimeError('x')")
    assert from_wire(pickle.loads(pickle.dumps(to_wire(dead)))) == dead
