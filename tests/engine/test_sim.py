"""The simulated engine: the timing model's step cost, the capacity maths' block count, the real KV accounting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfleet import capacity
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import Sequence
from kvfleet.engine.sim import SimConfigError, SimRunner, TimingModel, kv_blocks_for_hardware
from kvfleet.engine.tokenizer.byte_level import ByteTokenizer


def _plan() -> SchedulerPlan:
    prefill = Sequence("a", list(range(10)), SamplingParams())
    decode = Sequence("b", list(range(20)), SamplingParams(), output_token_ids=[1, 2, 3])
    return SchedulerPlan(
        scheduled=(
            ScheduledSeq(prefill, num_computed_before=0, num_new_tokens=10, block_ids=(0,)),
            ScheduledSeq(decode, num_computed_before=22, num_new_tokens=1, block_ids=(1, 2)),
        )
    )


def test_a_step_costs_the_base_plus_its_batched_tokens_plus_its_context() -> None:
    timing = TimingModel(base_s=0.005, per_token_s=1e-4, per_context_token_s=1e-6)
    # 11 batched tokens (a 10-token prefill chunk and one decode); contexts 10 + 23.
    assert timing.step_seconds(_plan()) == pytest.approx(0.005 + 11e-4 + 33e-6)
    assert timing.step_seconds(SchedulerPlan()) == 0.0
    per_row = TimingModel(base_s=0.005, per_token_s=1e-4, per_context_token_s=1e-6, per_row_s=1e-3)
    assert per_row.step_seconds(_plan()) == pytest.approx(0.005 + 11e-4 + 33e-6 + 2e-3)  # two sequences


def test_the_hardware_timing_comes_from_the_capacity_maths() -> None:
    timing = TimingModel.for_hardware("h100", "llama-3-8b")
    # Llama 3 8B: 32 layers × 8 KV heads × 128 dims × K and V × 2 bytes = 131072 bytes per token.
    assert capacity.kv_bytes_per_token(capacity.resolve_model("llama-3-8b")) == 131072
    assert timing.per_context_token_s == 131072 / 3.35e12
    assert timing.base_s == pytest.approx(16.06e9 / 3.35e12, rel=0.01)  # read every bf16 weight once
    assert timing.per_token_s == pytest.approx(2 * 8.03e9 / (989e12 * 0.5), rel=0.01)


def test_the_block_count_is_the_kv_memory_over_the_block_size() -> None:
    assert kv_blocks_for_hardware("h100", "llama-3-8b", block_size=16, kv_cache_memory=1 << 30) == 512
    plan = capacity.plan_capacity(
        capacity.resolve_model("llama-3-8b"),
        capacity.resolve_gpu("h100"),
        context=2048,
        max_num_batched_tokens=2048,
    )
    assert kv_blocks_for_hardware("h100", "llama-3-8b", block_size=16) == plan.kv_bytes // (131072 * 16)


def test_an_unknown_gpu_and_a_bad_speedup_are_refused_by_name() -> None:
    with pytest.raises(capacity.UnknownGPUError, match="unknown GPU 'h900'"):
        TimingModel.for_hardware("h900", "llama-3-8b")
    with pytest.raises(SimConfigError, match="sim_speedup must be > 0"):
        SimRunner(8, TimingModel(0, 0, 0), speedup=0)
    with pytest.raises(SimConfigError, match="base_s must be >= 0"):
        TimingModel(-1, 0, 0)


def test_the_runner_sleeps_the_step_over_the_speedup_and_samples_the_alphabet() -> None:
    slept: list[float] = []
    runner = SimRunner(8, TimingModel(0.01, 0.0, 0.0), speedup=4, sleep=slept.append)
    plan = _plan()
    samples = runner.execute(plan)
    assert slept == [0.0025]
    assert runner.simulated_seconds == 0.01
    # Both entries reach the end of their tokens: the prefill samples its 1st token, the decode its 4th.
    prefill, decode = (s.seq.seq_id for s in plan.scheduled)
    assert {sid: s.token_id for sid, s in samples.items()} == {prefill: ord("a"), decode: ord("d")}


def _engine(num_kv_blocks: int, **config: object) -> Engine:
    cfg = EngineConfig(num_kv_blocks=num_kv_blocks, max_model_len=1024, device="cpu", **config)  # type: ignore[arg-type]
    return Engine(cfg, runner=SimRunner(num_kv_blocks, TimingModel(0, 0, 0)), tokenizer=ByteTokenizer())


def test_the_real_engine_over_the_simulator_accounts_blocks_and_never_emits_eos() -> None:
    engine = _engine(8)
    engine.add_request("r", list(range(40)), SamplingParams(max_tokens=30))
    (first,) = engine.step()  # the 40-token prompt and the first output token: 3 blocks of 16
    assert (engine.stats().num_running, engine.stats().kv_cache_usage) == (1, 3 / 8)
    text, finish = first.seqs[0].new_text, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text, finish = text + out.seqs[0].new_text, out.seqs[0].finish_reason
    assert (text, finish) == (
        "abcdefghijklmnopqrstuvwxyzabcd",
        "length",
    )
    assert engine.stats().kv_cache_usage == 0.0


def test_two_requests_that_outgrow_the_cache_preempt_one() -> None:
    engine = _engine(6, enable_prefix_caching=False)
    for rid in ("a", "b"):
        engine.add_request(rid, list(range(30)), SamplingParams(max_tokens=40))
    finished: dict[str, str] = {"a": "", "b": ""}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] += o.seqs[0].new_text
    assert engine.stats().num_preemptions >= 1
    assert finished == {
        "a": ("abcdefghijklmnopqrstuvwxyz" * 2)[:40],
        "b": ("abcdefghijklmnopqrstuvwxyz" * 2)[:40],
    }


def test_a_simulated_server_serves_a_request_without_importing_torch() -> None:
    code = """
import argparse, sys
from starlette.testclient import TestClient
from kvfleet.engine import cli
from kvfleet.engine.server.app import create_app
p = argparse.ArgumentParser(); cli.add_arguments(p)
state = cli.build_server_state(p.parse_args(["--simulate", "--num-kv-blocks", "16", "--sim-speedup", "1000"]))
with TestClient(create_app(state)) as c:
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
print(r.json()["choices"][0]["text"], "torch" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.split()
    assert out == ["abc", "False"]


def test_a_step_time_target_holds_on_the_simulated_clock_not_the_wall_clock() -> None:
    """Issue #33: the engine's cost model learns the simulator's seconds (here 1000x the wall clock's),
    so a burst of long prompts beside running streams keeps every simulated step near the target."""
    timing = TimingModel(base_s=0.005, per_token_s=1e-4, per_context_token_s=1e-6)
    cfg = EngineConfig(
        num_kv_blocks=2048, max_model_len=4096, device="cpu", target_step_ms=20.0, stall_free=True
    )
    runner = SimRunner(2048, timing, speedup=1000.0)
    engine = streams_then_a_burst(cfg, runner, warm_steps=5, prompts=8, prompt_len=1000)
    seconds, rows, bounds = [], [], []
    while any(f"p{i}" in engine._requests for i in range(8)):
        # the target, or 2.5x the decode step midway while the 1000-token prompts make it dearer
        bounds.append(max(0.020, 2.5 * midway_seconds(engine, timing)))
        engine.step()
        seconds.append(runner.last_step_seconds)
        rows.append(sum(1 for s in engine.scheduler.running if s.request_id.startswith("d")))
    assert min(rows) == 8  # the streams ran through the burst
    # the first steps (the very first unobserved) learn; on the wall clock every step would be 1000x off
    assert all(t <= bound * 1.05 for t, bound in zip(seconds[4:], bounds[4:], strict=True))
    assert max(seconds[-10:]) <= 0.020 * 1.05  # the last prompts' chunks: the target's alone
    assert len(seconds) < 8000 * 1e-4 / (0.020 - 0.0065) * 1.5  # chunks near the target's size
    fixed, per_token, per_row, per_context = engine.scheduler.step_cost.coefficients()
    assert per_token + per_context == pytest.approx(1e-4 + 1e-6, rel=0.1)


def streams_then_a_burst(
    cfg: EngineConfig, runner: SimRunner, warm_steps: int, prompts: int, prompt_len: int
) -> Engine:
    """An engine on ``runner`` with 8 streams (d0..d7) decoding for ``warm_steps`` steps, then a burst
    of ``prompts`` prompts (p0..) of ``prompt_len`` tokens, each asking for 2 tokens, just added."""
    engine = Engine(cfg, runner=runner, tokenizer=ByteTokenizer())
    for i in range(8):
        engine.add_request(f"d{i}", [1 + i] * 8, SamplingParams(max_tokens=400))
    for _ in range(warm_steps):
        engine.step()
    for i in range(prompts):
        engine.add_request(f"p{i}", [20 + i] * prompt_len, SamplingParams(max_tokens=2))
    return engine


def midway_seconds(engine: Engine, timing: TimingModel) -> float:
    """The simulated decode step midway through a burst, before the engine plans its next step: the
    sequences decoding and half of those prefilling or waiting, each a row over its tokens (what a
    stall-free step's bound is K x, K = 2 by default)."""
    sched = engine.scheduler
    decoding = [s for s in sched.running if s.num_tokens - s.num_computed_tokens == 1]
    joining = [s for s in [*sched.running, *sched.waiting] if s not in decoding]
    rows = len(decoding) + len(joining) / 2
    context = sum(s.num_tokens for s in decoding) + sum(s.num_tokens for s in joining) / 2
    return (
        timing.base_s + (timing.per_token_s + timing.per_row_s) * rows + timing.per_context_token_s * context
    )


def test_without_a_target_every_simulated_step_with_prefill_stays_within_the_factor_times_the_step_midway() -> (
    None
):
    """Issue #33's default: a burst of long prompts beside 8 streams; each step that carries prefill
    takes at most K = 2x (the default) the decode step midway from the streams to the batch they make with the prompts
    (on the simulated clock: the cost model, fitted to it, learns the timing model's costs)."""
    timing = TimingModel(base_s=0.02, per_token_s=0.0012, per_context_token_s=5e-6, per_row_s=0.001)
    cfg = EngineConfig(num_kv_blocks=2048, max_model_len=4096, device="cpu", stall_free=True)
    runner = SimRunner(2048, timing)
    engine = streams_then_a_burst(cfg, runner, warm_steps=20, prompts=4, prompt_len=500)
    plans: list[SchedulerPlan] = []
    execute = runner.execute
    runner.execute = lambda plan: plans.append(plan) or execute(plan)  # type: ignore[method-assign]
    ratios = []
    while any(f"p{i}" in engine._requests for i in range(4)):
        bound_s = midway_seconds(engine, timing)
        engine.step()
        if any(e.num_new_tokens > 1 for e in plans[-1].scheduled):
            ratios.append(runner.last_step_seconds / bound_s)
    assert cfg.stall_free_factor == 2.0
    assert 44 < len(ratios) < 58  # 2000 prompt tokens in chunks of about 40 (K=2.5: about 62, 32 steps)
    assert max(ratios) <= 2.0 * 1.05
