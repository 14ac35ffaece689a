"""The tensor-parallel tests' worker check (:mod:`.workers`) passes on two real ranks and fails on a
silent fallback to one process, which would otherwise give tp=1's tokens and pass every comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.runner.model_runner import ModelRunner

from .workers import assert_workers_ran

GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def _generated(tp: int) -> LLM:
    llm = LLM("tiny", tensor_parallel_size=tp, num_kv_blocks=32)
    llm.generate([[256, 1, 2, 3]], GREEDY)
    return llm


def test_two_ranks_pass_the_check_with_a_live_worker_that_reduced() -> None:
    llm = _generated(2)
    try:
        assert_workers_ran(llm, 2)
    finally:
        llm.close()


def test_the_check_fails_when_tensor_parallel_size_2_silently_runs_in_one_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_init = ModelRunner.__init__

    def one_process(self: ModelRunner, config: EngineConfig, model_path: Path | str) -> None:
        real_init(self, config.model_copy(update={"tensor_parallel_size": 1}), model_path)

    monkeypatch.setattr(ModelRunner, "__init__", one_process)
    llm = _generated(2)
    try:
        assert llm.engine.runner.leader is None  # the forced fallback took: one process, tp=1's tokens
        with pytest.raises(AssertionError, match="tensor_parallel_size=2 ran in one process"):
            assert_workers_ran(llm, 2)
    finally:
        llm.close()
