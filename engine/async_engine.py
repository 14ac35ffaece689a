"""The engine loop off the HTTP event loop: one thread steps the engine, asyncio streams read it.

Where it sits: ``engine/server`` routes call :meth:`AsyncEngine.generate` and iterate the
returned :class:`RequestStream`; a dedicated thread runs ``Engine.step()`` back to back
and hands every :class:`RequestOutput` to its stream's asyncio queue with
``loop.call_soon_threadsafe``. A long model step therefore never blocks the event loop:
other streams keep flushing, health checks keep answering.

The engine itself is touched only by that thread. ``generate`` and ``abort`` enqueue
commands; the thread applies them between steps, so they are thread-safe and never wait
for a step to end (``generate`` awaits only the verdict of ``add_request``).
The thread also stamps each request's timeline (arrival, first token, each token) for the
latency histograms, and keeps a snapshot of ``Engine.stats()`` that ``/load`` and
``/metrics`` read without touching the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineCore(Protocol):
    """What the loop needs of ``kvfleet.engine.Engine`` (only ever called from the loop's thread)."""

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None: ...

    def abort(self, request_id: str) -> RequestOutput | None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> Any: ...


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or the server is shutting down)."""


@dataclass
class RequestMetrics:
    """One request's timeline, stamped by the loop thread (``time.monotonic`` seconds)."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int = 0
    scheduled_time: float | None = None  # start of the step that produced the request's first output
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)  # one per token after the first
    num_cached_tokens: int = 0
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for fewer than two tokens)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


class RequestObserver(Protocol):
    """Told about request milestones from the loop thread (the server's Prometheus metrics)."""

    def on_first_token(self, metrics: RequestMetrics) -> None: ...

    def on_tokens(self, metrics: RequestMetrics, num_new: int, gap: float | None) -> None: ...

    def on_finished(self, metrics: RequestMetrics) -> None: ...


_END = object()  # closes a stream whose request was aborted or whose engine died


class RequestStream:
    """The outputs of one request, in order; iterate with ``async for``."""

    def __init__(self, request_id: str, metrics: RequestMetrics) -> None:
        self.request_id = request_id
        self.metrics = metrics
        self.finished = False
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if item is _END:
                self.finished = True
                return
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item


@dataclass
class _Add:
    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    verdict: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs an engine in its own thread; serves asyncio callers (see the module docstring)."""

    def __init__(
        self,
        engine: EngineCore,
        *,
        observer: RequestObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        idle_wait_s: float = 0.5,
    ) -> None:
        self._engine = engine
        self.observer = observer
        self._clock = clock
        self._idle_wait_s = idle_wait_s
        self._commands: deque[_Add | _Abort] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.stats_snapshot: Any = engine.stats()
        self.num_steps = 0

    # -- lifecycle (event loop side) -------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet finished (read from any thread; a dict's len is atomic)."""
        return len(self._streams)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._streams.copy())  # dict.copy is atomic; the loop thread may be mutating it

    # -- requests (event loop side, thread-safe) -----------------------------------------------

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0
    ) -> RequestStream:
        """Add a request; return its stream once the engine accepted it (its ValueError otherwise)."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        num_prompt = len(prompt) if isinstance(prompt, list) else 0
        stream = RequestStream(request_id, RequestMetrics(request_id, self._clock(), num_prompt))
        verdict: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._send(_Add(stream, prompt, params, priority, verdict))
        try:
            await verdict
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left before the verdict: don't leak the sequence
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def _send(self, command: _Add | _Abort) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    # -- the loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._wait_for_work():
                self._apply_commands()
                if self._engine.has_unfinished_requests():
                    started = self._clock()
                    outputs = self._engine.step()
                    self.num_steps += 1
                    self._deliver(outputs, started, self._clock())
                self.stats_snapshot = self._engine.stats()
        except BaseException as exc:  # the engine is broken: fail every stream rather than hang them
            log.exception("engine loop failed")
            self.error = exc
            self._fail_all(EngineDeadError(f"the engine loop failed: {exc!r}"))
        else:
            self._fail_all(EngineDeadError("the engine is shutting down"))

    def _wait_for_work(self) -> bool:
        """Block while idle; False once stopping."""
        with self._wake:
            while not self._stopping and not self._commands and not self._engine.has_unfinished_requests():
                self._wake.wait(self._idle_wait_s)
            return not self._stopping

    def _apply_commands(self) -> None:
        with self._wake:
            commands, self._commands = list(self._commands), deque()
        for command in commands:
            if isinstance(command, _Add):
                self._apply_add(command)
            else:
                self._apply_abort(command.request_id)

    def _apply_add(self, cmd: _Add) -> None:
        rid = cmd.stream.request_id
        try:
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already running")
            self._engine.add_request(
                rid,
                cmd.prompt,
                cmd.params,
                priority=cmd.priority,
                arrival_time=cmd.stream.metrics.arrival_time,
            )
        except ValueError as exc:  # RequestError / SamplingParamsError: the caller's 400
            self._call(_settle, cmd.verdict, exc)
            return
        self._streams[rid] = cmd.stream
        self._call(_settle, cmd.verdict, None)

    def _apply_abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished already, or never accepted
        final = self._engine.abort(request_id)
        if final is None:
            stream.metrics.finish_reason = "abort"
            self._call(stream._put, _END)
            return
        self._stamp(stream.metrics, final, self._clock())
        self._call(stream._put, final)

    def _deliver(self, outputs: list[RequestOutput], started: float, now: float) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if stream.metrics.scheduled_time is None:
                stream.metrics.scheduled_time = started
            self._stamp(stream.metrics, out, now)
            if out.finished:
                del self._streams[out.request_id]
            self._call(stream._put, out)

    def _stamp(self, m: RequestMetrics, out: RequestOutput, now: float) -> None:
        new_tokens = sum(len(c.new_token_ids) for c in out.outputs)
        m.num_prompt_tokens = len(out.prompt_token_ids)
        m.num_cached_tokens = out.num_cached_tokens
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
        if out.finished:
            m.finished_time = now
            m.finish_reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None)
            if self.observer is not None:
                self.observer.on_finished(m)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self._call(stream._put, exc)
        with self._wake:
            pending = [c for c in self._commands if isinstance(c, _Add)]
            self._commands.clear()
        for cmd in pending:
            self._call(_settle, cmd.verdict, exc)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(fn, *args)


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
