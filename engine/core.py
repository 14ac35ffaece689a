"""The engine core: the loop that owns an ``Engine``, and the messages it trades with the API side.

Where it sits: between the HTTP server (``engine/async_engine.py``, in the API process) and
``Engine.step()``. The API side sends :class:`AddCmd` / :class:`AbortCmd`; the core applies
them between steps, steps the engine, and answers with one :class:`StepBatch` per loop
iteration carrying the verdicts on new requests, the step's :class:`ReqDelta` values as
``Engine.step()`` made them (new tokens, text and logprobs, never a cumulative output), and a
snapshot of ``Engine.stats()``.
One loop, :meth:`CoreLoop.run`, serves both transports: a thread (:class:`ThreadCore`, tests
and ``--engine-core thread``) or its own process (``engine/core_process.py``, the default, so
the model step and the HTTP/SSE work do not share one GIL); each transport only says how a
command is received and how a batch is sent.

Detokenisation and stop strings stay in the core (inside ``Engine.step``): stop strings
need the text, and the work is small beside the step (measured: 4 µs per token for the
tiny model's tokenizer, against about 300 µs of CPU per token for the step itself on CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, Protocol

from kvfleet.engine.lora.config import LoraError
from kvfleet.engine.outputs import EngineStats, ReqDelta
from kvfleet.engine.sampling_params import RequestError, SamplingParams

log = logging.getLogger(__name__)


class EngineLike(Protocol):
    """What the core needs of ``kvfleet.engine.Engine`` (only ever called from the core's loop)."""

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> list[int]: ...

    def verdict_deferred(self, request_id: str) -> bool: ...

    def take_verdicts(self) -> list[tuple[str, RequestError | None]]: ...

    def load_lora(self, name: str, path: str) -> None: ...

    def unload_lora(self, name: str) -> None: ...

    def abort(self, request_id: str) -> ReqDelta | None: ...

    def step(self) -> list[ReqDelta]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...


# ---- API side → core
class AddCmd(NamedTuple):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    lora: str | None = None  # the LoRA adapter's name; None: the base model


class LoraCmd(NamedTuple):
    """Load (``path`` set) or unload (``path`` None) an adapter; answered by a Verdict for ``op_id``."""

    op_id: str
    name: str
    path: str | None


class AbortCmd(NamedTuple):
    request_id: str


class ShutdownCmd(NamedTuple):
    reason: str = "the engine is shutting down"


Command = AddCmd | AbortCmd | LoraCmd | ShutdownCmd


# ---- core → API side
class Verdict(NamedTuple):
    """The engine's answer to one AddCmd: accepted (reason None) or its RequestError's reason and field."""

    request_id: str
    reason: str | None = None
    field: str | None = None
    status: int = 400  # the HTTP status of a refusal (LoraError's: 404 unknown adapter, 409 in use)
    code: str | None = None


class StepBatch(NamedTuple):
    """One loop iteration's news. ``step_started`` is None when no step ran (verdicts, aborts only)."""

    now: float  # time.monotonic() of the core when the batch was made (shared clock on one host)
    step_started: float | None
    verdicts: list[Verdict]
    deltas: list[ReqDelta]
    stats: EngineStats | None  # None only in the batch that reports a core that died before greeting
    error: str | None = None  # set once: the core is dead, every stream fails with this


Receive = Callable[[float], list[Command]]  # waits up to that many seconds; what arrived, maybe nothing
Send = Callable[[StepBatch], None]


class CoreLoop:
    """The engine with its inbox applied between steps: :meth:`run` is the loop every transport runs."""

    def __init__(
        self, engine: EngineLike, clock: Callable[[], float] = time.monotonic, idle_wait_s: float = 0.5
    ) -> None:
        self.engine = engine
        self._clock = clock
        self._idle_wait_s = idle_wait_s
        self._verdicts: list[Verdict] = []
        self._deltas: list[ReqDelta] = []
        self._step_started: float | None = None

    # Invariant: commands are applied in the order sent, only between steps; a verdict leaves
    # before the step that follows it; one batch per step, and one per idle turn that applied commands.
    def run(self, receive: Receive, send: Send) -> None:
        """Serve until a :class:`ShutdownCmd` arrives. What receive or send raise, and what the
        engine raises, propagates: the transport decides how a failure is reported."""
        while True:
            commands = receive(0.0 if self.has_work else self._idle_wait_s)
            if any(isinstance(c, ShutdownCmd) for c in commands):
                return
            self.apply(commands)
            if self._verdicts and self.has_work:
                send(self.take_batch())  # a verdict (400 or go) should not wait for a long step
            if self.has_work:
                self.step()
                send(self.take_batch())
            elif commands:
                send(self.take_batch())  # aborts and refusals change the stats too

    def apply(self, commands: list[Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, AddCmd):
                self._add(cmd)
            elif isinstance(cmd, AbortCmd):
                final = self.engine.abort(cmd.request_id)
                if final is not None:
                    self._deltas.append(final)
            elif isinstance(cmd, LoraCmd):
                self._lora(cmd)

    def _add(self, cmd: AddCmd) -> None:
        try:
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.params,
                priority=cmd.priority,
                arrival_time=cmd.arrival_time,
                lora=cmd.lora,
            )
        except RequestError as exc:  # the caller's 400
            self._verdicts.append(Verdict(cmd.request_id, exc.reason, exc.field))
            return
        except ValueError as exc:  # not raised as a RequestError, still about this request's input
            self._verdicts.append(Verdict(cmd.request_id, str(exc)))
            return
        if not self.engine.verdict_deferred(cmd.request_id):  # else: once its grammar compiled
            self._verdicts.append(Verdict(cmd.request_id))

    def _lora(self, cmd: LoraCmd) -> None:
        try:
            if cmd.path is None:
                self.engine.unload_lora(cmd.name)
            else:
                self.engine.load_lora(cmd.name, cmd.path)
        except LoraError as exc:
            self._verdicts.append(Verdict(cmd.op_id, exc.reason, exc.field, exc.status, exc.code))
            return
        self._verdicts.append(Verdict(cmd.op_id))

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> None:
        self._step_started = self._clock()
        self._deltas.extend(self.engine.step())

    def take_batch(self) -> StepBatch:
        for request_id, error in self.engine.take_verdicts():
            refusal = () if error is None else (error.reason, error.field)
            self._verdicts.append(Verdict(request_id, *refusal))
        batch = StepBatch(
            self._clock(), self._step_started, self._verdicts, self._deltas, self.engine.stats()
        )
        self._verdicts, self._deltas, self._step_started = [], [], None
        return batch

    def failed(self, exc: BaseException) -> StepBatch:
        """The last batch of a core whose engine raised: every stream fails with it."""
        log.error("engine core failed", exc_info=exc)
        return StepBatch(self._clock(), None, [], [], self.engine.stats(), f"the engine loop failed: {exc!r}")


Deliver = Callable[[StepBatch], None]


class CoreTransport(Protocol):
    """How the API side reaches a core: a thread here, or a process (``engine/core_process.py``)."""

    @property
    def initial_stats(self) -> EngineStats: ...

    @property
    def alive(self) -> bool: ...

    def start(self, deliver: Deliver, loop: asyncio.AbstractEventLoop) -> None: ...

    def send(self, command: Command) -> None: ...

    def stop(self, timeout: float) -> None: ...


class ThreadCore:
    """The core loop in a thread of this process; batches reach the event loop via call_soon_threadsafe."""

    def __init__(
        self, engine: EngineLike, *, clock: Callable[[], float] = time.monotonic, idle_wait_s: float = 0.5
    ) -> None:
        self.core = CoreLoop(engine, clock, idle_wait_s)
        self.initial_stats = engine.stats()
        self._inbox: deque[Command] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._deliver: Deliver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, deliver: Deliver, loop: asyncio.AbstractEventLoop) -> None:
        self._deliver, self._loop = deliver, loop
        self._thread = threading.Thread(target=self._run, name="kvfleet-engine-core", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    def stop(self, timeout: float = 5.0) -> None:
        self.send(ShutdownCmd())
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.core.run(self._receive, self._emit)
        except BaseException as exc:  # the engine is broken: fail every stream rather than hang them
            self._emit(self.core.failed(exc))

    def _receive(self, timeout: float) -> list[Command]:
        with self._wake:
            if not self._inbox and timeout > 0:
                self._wake.wait(timeout)
            commands, self._inbox = list(self._inbox), deque()
        return commands

    def _emit(self, batch: StepBatch) -> None:
        assert self._loop is not None and self._deliver is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._deliver, batch)
