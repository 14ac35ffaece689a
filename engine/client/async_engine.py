"""The API side of the engine core: asyncio streams fed by the core's per-step batches.

Where it sits: ``engine/server`` routes call :meth:`AsyncEngine.generate` and iterate the
returned :class:`RequestStream`. The engine itself runs elsewhere, behind a
``CoreTransport`` (``engine/client/core_client.py``): in its own process by default
(:class:`~kvfleet.engine.client.core_client.ProcessCore`), or in a thread
(:class:`~kvfleet.engine.client.core_client.ThreadCore`).
Either way a long model step never blocks this event loop.

``generate`` and ``abort`` only send commands; ``generate`` awaits the engine's verdict
on ``add_request`` (a ``RequestError`` naming the field, or go). Each :class:`StepBatch`
arrives on the event loop, where this module stamps each request's timeline (arrival
here, first token and each token at the core's clock: one ``time.monotonic`` per host)
for the latency histograms and keeps the core's ``Engine.stats()`` snapshot that
``/load`` and ``/metrics`` read.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvfleet.engine.client.core_client import CoreTransport
from kvfleet.engine.client.request_stream import RequestMetrics, RequestStream
from kvfleet.engine.core.messages import AbortCmd, AddCmd, EmbedCmd, Embedded, LoraCmd, StepBatch, Verdict
from kvfleet.engine.lora.config import LoraError
from kvfleet.engine.outputs import EngineStats, ReqDelta
from kvfleet.engine.sampling_params import RequestError, SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "RequestMetrics", "RequestObserver", "RequestStream"]


class EngineDeadError(RuntimeError):
    """The engine core stopped (a step raised, its process died, or the server is shutting down)."""


class RequestObserver(Protocol):
    """Told about request milestones on the event loop (the server's Prometheus metrics)."""

    def on_first_token(self, metrics: RequestMetrics) -> None: ...

    def on_tokens(self, metrics: RequestMetrics, num_new: int, gap: float | None) -> None: ...

    def on_finished(self, metrics: RequestMetrics) -> None: ...


@dataclass
class _Pending:
    stream: RequestStream
    verdict: asyncio.Future[None]


class AsyncEngine:
    """Streams for asyncio callers over an engine core (see the module docstring)."""

    def __init__(
        self,
        core: CoreTransport,
        *,
        observer: RequestObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.observer = observer
        self._clock = clock
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[str, _Pending] = {}
        self._lora_ops: dict[str, asyncio.Future[None]] = {}
        self._embeds: dict[str, asyncio.Future[Embedded]] = {}
        self._op_ids = itertools.count()
        self._started = False
        self._stopped = False
        self.error: str | None = None
        self._stats: EngineStats = core.initial_stats

    @property
    def stats_snapshot(self) -> EngineStats:
        """The core's latest stats, with the embeddings requests it holds (``--runner pooling``) counted as requests.

        The core pools one EmbedCmd at a time between steps and keeps no sequence for it, so its own
        counts miss them: the oldest unanswered one is running, the others wait (what ``/load`` and the
        running/waiting gauges report, so a picker sees a busy pooling engine as busy)."""
        embeds = len(self._embeds)
        if not embeds:
            return self._stats
        s = self._stats
        return replace(s, num_running=s.num_running + 1, num_waiting=s.num_waiting + embeds - 1)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self.core.start(self._on_batch, asyncio.get_running_loop())
        self._started = True

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self.core.stop(timeout)
        self._fail_all("the engine is shutting down")

    @property
    def is_running(self) -> bool:
        return self._started and not self._stopped and self.error is None and self.core.alive

    @property
    def dead_reason(self) -> str | None:
        """Why the core stopped on its own (a failed step, a dead process); None while it runs or was stopped."""
        if not self._started or self._stopped:
            return None
        if self.error is not None:
            return self.error
        return None if self.core.alive else "the engine core is not running"

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished."""
        return len(self._streams)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._streams)

    # -- requests ----------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        lora: str | None = None,
    ) -> RequestStream:
        """Add a request; return its stream once the engine accepted it (its RequestError otherwise)."""
        if not self.is_running:
            raise EngineDeadError(f"the engine core is not running{f': {self.error}' if self.error else ''}")
        if request_id in self._streams or request_id in self._pending:
            raise RequestError("request_id", f"{request_id!r} is already running")
        arrival = self._clock()
        num_prompt = len(prompt) if isinstance(prompt, list) else 0
        stream = RequestStream(request_id, RequestMetrics(request_id, arrival, num_prompt))
        verdict: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = _Pending(stream, verdict)
        self.core.send(AddCmd(request_id, prompt, params, priority, arrival, lora))
        try:
            await verdict
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left before the verdict: don't leak the sequence
            raise
        return stream

    async def lora_op(self, name: str, path: str | None) -> None:
        """Load (``path`` set) or unload (None) an adapter in the core; its :class:`LoraError` if refused."""
        if not self.is_running:
            raise EngineDeadError(f"the engine core is not running{f': {self.error}' if self.error else ''}")
        op_id = f"lora-op-{next(self._op_ids)}"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lora_ops[op_id] = done
        self.core.send(LoraCmd(op_id, name, path))
        await done

    async def embed(self, request_id: str, prompts: list[list[int]], dimensions: int | None) -> Embedded:
        """The core's embeddings of ``prompts`` (``--runner pooling``); its RequestError if it refused them."""
        if not self.is_running:
            raise EngineDeadError(f"the engine core is not running{f': {self.error}' if self.error else ''}")
        if request_id in self._embeds:
            raise RequestError("request_id", f"{request_id!r} is already running")
        done: asyncio.Future[Embedded] = asyncio.get_running_loop().create_future()
        self._embeds[request_id] = done
        self.core.send(EmbedCmd(request_id, prompts, dimensions))
        result = await done  # a caller that leaves drops the answer: the core does the work once anyway
        if result.reason is not None:
            raise RequestError(result.field, result.reason)
        return result

    def abort(self, request_id: str) -> None:
        """Ask the core to abort; the stream ends with the core's final "abort" output."""
        self.core.send(AbortCmd(request_id))

    # -- batches from the core (on the event loop) ------------------------------------------------------

    def _on_batch(self, batch: StepBatch) -> None:
        if batch.stats is not None:
            self._stats = batch.stats
        for v in batch.verdicts:
            self._settle(v)
        started = batch.step_started if batch.step_started is not None else batch.now
        for delta in batch.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # its caller left before the verdict
            self._stamp(stream.metrics, delta, started, batch.now)
            if delta.finished:
                del self._streams[delta.request_id]
            stream.push(delta)
        for e in batch.embedded:
            waiting = self._embeds.pop(e.request_id, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(e)
        if batch.error is not None and self.error is None:
            self.error = batch.error
            self._fail_all(batch.error)

    def _settle(self, v: Verdict) -> None:
        op = self._lora_ops.pop(v.request_id, None)
        if op is not None:
            if op.done():
                return
            if v.reason is None:
                op.set_result(None)
            else:
                op.set_exception(LoraError(v.field, v.reason, v.status, v.code))
            return
        pending = self._pending.pop(v.request_id, None)
        if pending is None or pending.verdict.done():
            return  # cancelled: its abort follows the add and frees the sequence
        if v.reason is not None:
            pending.verdict.set_exception(RequestError(v.field, v.reason))
            return
        self._streams[v.request_id] = pending.stream
        pending.verdict.set_result(None)

    def _stamp(self, m: RequestMetrics, d: ReqDelta, started: float, now: float) -> None:
        new_tokens = 0
        for s in d.seqs:
            new_tokens += len(s.new_token_ids)
            if s.choice == 0 and s.finish_reason is not None:
                m.finish_reason = s.finish_reason  # the first choice's, as the response's first choice
        m.num_prompt_tokens = d.num_prompt_tokens
        m.num_cached_tokens = d.num_cached_tokens
        if m.scheduled_time is None:
            m.scheduled_time = started
        if new_tokens:
            gap = None if m.last_token_time is None else now - m.last_token_time
            if gap is not None:
                m.inter_token_latencies.append(gap)
            m.num_generation_tokens += new_tokens
            m.last_token_time = now
            if m.first_token_time is None:
                m.first_token_time = now
                if self.observer is not None:
                    self.observer.on_first_token(m)
            if self.observer is not None:
                self.observer.on_tokens(m, new_tokens, gap)
        if d.finished:
            m.finished_time = now
            if self.observer is not None:
                self.observer.on_finished(m)

    def _fail_all(self, message: str) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.fail(EngineDeadError(message))
        pending, self._pending = list(self._pending.values()), {}
        waiting: list[asyncio.Future[Any]] = [p.verdict for p in pending] + list(self._lora_ops.values())
        waiting += list(self._embeds.values())
        self._lora_ops, self._embeds = {}, {}
        for future in waiting:
            if not future.done():
                future.set_exception(EngineDeadError(message))
