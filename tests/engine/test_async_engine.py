"""The engine core behind AsyncEngine, in a thread: the event loop stays free during a step; timelines are exact."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from kvfleet.engine.client.async_engine import AsyncEngine, EngineDeadError
from kvfleet.engine.client.core_client import ThreadCore
from kvfleet.engine.client.request_stream import RequestMetrics
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sim import SimRunner, TimingModel
from kvfleet.engine.tokenizer.byte_level import ByteTokenizer


def _engine(sleep: Callable[[float], None], step_s: float = 0.01) -> Engine:
    config = EngineConfig(num_kv_blocks=32, max_model_len=512, device="cpu")
    runner = SimRunner(32, TimingModel(step_s, 0.0, 0.0), sleep=sleep)
    return Engine(config, runner=runner, tokenizer=ByteTokenizer())


class Recorder:
    def __init__(self) -> None:
        self.first: list[RequestMetrics] = []
        self.finished: list[RequestMetrics] = []
        self.tokens = 0

    def on_first_token(self, m: RequestMetrics) -> None:
        self.first.append(m)

    def on_tokens(self, m: RequestMetrics, num_new: int, gap: float | None) -> None:
        self.tokens += num_new

    def on_finished(self, m: RequestMetrics) -> None:
        self.finished.append(m)


async def test_the_event_loop_keeps_running_while_a_step_blocks() -> None:
    entered, gate = threading.Event(), threading.Event()

    def blocking_sleep(_: float) -> None:
        entered.set()
        gate.wait(10)

    engine = AsyncEngine(ThreadCore(_engine(blocking_sleep)))
    engine.start()
    try:
        stream = await engine.generate("a", [1, 2, 3], SamplingParams(max_tokens=2))
        await asyncio.to_thread(entered.wait, 10)
        ticks = 0
        for _ in range(5):  # the loop thread is inside the step; this coroutine still runs
            await asyncio.sleep(0)
            ticks += 1
        assert (ticks, gate.is_set(), stream.finished) == (5, False, False)
        gate.set()
        outs = [d.seqs[0] async for d in stream]  # one or two deltas: a lagging reader coalesces
        assert ("".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids]) == (
            "ab",
            [97, 98],
        )
    finally:
        gate.set()
        engine.stop()


async def test_each_request_gets_its_own_stream_and_exact_timeline_on_a_simulated_clock() -> None:
    now = [0.0]

    def advance(seconds: float) -> None:
        now[0] += seconds

    recorder = Recorder()
    clock = lambda: now[0]  # noqa: E731
    engine = AsyncEngine(ThreadCore(_engine(advance), clock=clock), observer=recorder, clock=clock)
    engine.start()
    try:
        a = await engine.generate("a", [1, 2, 3], SamplingParams(max_tokens=4))
        outs = [out async for out in a]
    finally:
        engine.stop()
    assert "".join(o.seqs[0].new_text for o in outs) == "abcd"
    m = a.metrics
    # Four 10 ms steps from an arrival at 0: the first token after one step, then one per step.
    assert (m.ttft, m.tpot, m.e2e, m.queue_time) == pytest.approx((0.01, 0.01, 0.04, 0.0))
    assert m.inter_token_latencies == pytest.approx([0.01, 0.01, 0.01])
    assert (m.num_prompt_tokens, m.num_generation_tokens, m.finish_reason) == (3, 4, "length")
    assert (recorder.first, recorder.finished, recorder.tokens) == ([m], [m], 4)


async def test_a_request_the_engine_refuses_raises_its_error_naming_the_field() -> None:
    engine = AsyncEngine(ThreadCore(_engine(lambda s: None)))
    engine.start()
    try:
        with pytest.raises(ValueError, match="^prompt: token id 999 at position 1") as info:
            await engine.generate("a", [1, 999], SamplingParams())
        assert getattr(info.value, "field", None) == "prompt"
        ok = await engine.generate("b", [1], SamplingParams(max_tokens=1))
        assert [o.seqs[0].new_text async for o in ok] == ["a"]
    finally:
        engine.stop()


async def test_abort_ends_the_stream_with_abort_and_frees_the_blocks() -> None:
    gate = threading.Event()
    engine = AsyncEngine(ThreadCore(_engine(lambda s: gate.wait(0.005))))
    engine.start()
    try:
        stream = await engine.generate("a", list(range(1, 40)), SamplingParams(max_tokens=400))
        first = await anext(aiter(stream))
        assert first.seqs[0].new_text == "a"
        engine.abort("a")
        rest = [o async for o in stream]
        assert rest[-1].seqs[0].finish_reason == "abort"
        while engine.num_unfinished or engine.stats_snapshot.kv_cache_usage:
            await asyncio.sleep(0.01)
        assert (engine.stats_snapshot.num_running, engine.stats_snapshot.kv_cache_usage) == (0, 0.0)
    finally:
        engine.stop()


async def test_a_failing_step_fails_every_stream_and_stops_the_loop() -> None:
    def explode(_: float) -> None:
        raise RuntimeError("device lost")

    engine = AsyncEngine(ThreadCore(_engine(explode)))
    engine.start()
    try:
        stream = await engine.generate("a", [1, 2], SamplingParams())
        with pytest.raises(EngineDeadError, match="device lost"):
            _ = [o async for o in stream]
        assert engine.is_running is False
        with pytest.raises(EngineDeadError, match="not running"):
            await engine.generate("b", [1], SamplingParams())
    finally:
        engine.stop()
