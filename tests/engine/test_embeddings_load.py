"""A pooling engine reports its embeddings requests as load: ``/load`` and the running/waiting gauges count them.

The core pools one EmbedCmd at a time between steps and keeps no sequence for it; the engine's
stats (what ``/load`` and ``ServerMetrics`` read) count the oldest unanswered one running and the
rest waiting, so a router's picker does not see a busy pooling engine as idle. The core here is
the real one in a thread, its runner a simulator whose pooling waits on a gate the test opens.
"""

from __future__ import annotations

import asyncio
import struct
import threading

from kvfleet.engine.client.async_engine import AsyncEngine
from kvfleet.engine.client.core_client import ThreadCore
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.server.metrics import ServerMetrics
from kvfleet.engine.sim import SimRunner, TimingModel
from kvfleet.engine.tokenizer.byte_level import ByteTokenizer


class GatedPooler(SimRunner):
    """Pools each prompt to a one-float vector (its length) once the test lets a batch through."""

    def __init__(self) -> None:
        super().__init__(32, TimingModel(0.0, 0.0, 0.0))
        self.entered, self.gate = threading.Semaphore(0), threading.Semaphore(0)

    def pool(self, prompts: list[list[int]], dimensions: int | None) -> list[bytes]:
        self.entered.release()
        assert self.gate.acquire(timeout=10)
        return [struct.pack("<f", float(len(p))) for p in prompts]


def gauges(metrics: ServerMetrics) -> tuple[float | None, float | None]:
    get = metrics.registry.get_sample_value
    return get("vllm:num_requests_running", {"model_name": "m"}), get(
        "vllm:num_requests_waiting", {"model_name": "m"}
    )


async def test_embeddings_in_flight_are_counted_running_then_waiting_until_answered() -> None:
    runner = GatedPooler()
    config = EngineConfig(num_kv_blocks=32, max_model_len=512, device="cpu")
    engine = AsyncEngine(ThreadCore(Engine(config, runner=runner, tokenizer=ByteTokenizer())))
    metrics = ServerMetrics("m", stats=lambda: engine.stats_snapshot)
    engine.start()
    try:
        idle = engine.stats_snapshot
        assert (idle.num_running, idle.num_waiting) == (0, 0) and gauges(metrics) == (0.0, 0.0)
        calls = [asyncio.create_task(engine.embed(f"e{i}", [[1, 2, 3][: i + 1]], None)) for i in range(3)]
        await asyncio.to_thread(runner.entered.acquire, True, 10)  # the core is pooling the first
        s = engine.stats_snapshot
        assert (s.num_running, s.num_waiting) == (1, 2) and gauges(metrics) == (1.0, 2.0)
        for _ in range(3):  # the answers may ride back together: the core applies queued commands in one go
            runner.gate.release()
        answered = await asyncio.wait_for(asyncio.gather(*calls), 10)
        assert [a.vectors for a in answered] == [[struct.pack("<f", float(n))] for n in (1, 2, 3)]
        s = engine.stats_snapshot
        assert (s.num_running, s.num_waiting) == (0, 0) and gauges(metrics) == (0.0, 0.0)
    finally:
        engine.stop()
