"""The engine core: the loop that owns an ``Engine`` and applies the API side's commands between steps.

Where it sits: between the API side (``engine/client/core_client.py``: :class:`~kvfleet.engine.client.core_client.ThreadCore`
runs :class:`CoreLoop` in a thread, :class:`~kvfleet.engine.client.core_client.ProcessCore` spawns
:func:`core_main` as a process of its own, the default, so the model step and the HTTP/SSE
work do not share one GIL) and ``Engine.step()``. The messages both sides trade are in
``engine/core/messages.py``: the API side sends :class:`~kvfleet.engine.core.messages.AddCmd` /
:class:`~kvfleet.engine.core.messages.AbortCmd`; the core applies them between steps, steps the
engine, and answers with one :class:`~kvfleet.engine.core.messages.StepBatch` per loop iteration
carrying the verdicts on new requests, the step's ``ReqDelta`` values as ``Engine.step()``
made them (new tokens, text and logprobs, never a cumulative output), and a snapshot of
``Engine.stats()``. One loop, :meth:`CoreLoop.run`, serves both transports; each only says
how a command is received and how a batch is sent.

Detokenisation and stop strings stay in the core (inside ``Engine.step``): stop strings
need the text, and the work is small beside the step (measured: 4 µs per token for the
tiny model's tokenizer, against about 300 µs of CPU per token for the step itself on CPU).

The core process (:func:`core_main`, as vLLM v1's EngineCore, SGLang's scheduler process)
builds the ``Engine`` from a picklable factory, says :class:`~kvfleet.engine.core.messages.Hello`,
then runs the loop over a socket pair (framed pickles, ``engine/link.py``), its batches
as plain tuples (:func:`~kvfleet.engine.core.messages.to_wire`). It ignores SIGINT and SIGTERM
(the API process drains, then sends :class:`~kvfleet.engine.core.messages.ShutdownCmd`), and exits
when told to, when the link reaches EOF (the API process died, even by SIGKILL: the kernel
closes its end), or when its parent pid changes (it was orphaned), so it never outlives the
server.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvfleet.engine.core.messages import (
    AbortCmd,
    AddCmd,
    Command,
    EmbedCmd,
    Embedded,
    Hello,
    LoraCmd,
    ShutdownCmd,
    StartFailed,
    StepBatch,
    Verdict,
    to_wire,
)
from kvfleet.engine.core.pooling import embed
from kvfleet.engine.link import BlockingLink
from kvfleet.engine.lora.config import LoraError
from kvfleet.engine.outputs import ReqDelta
from kvfleet.engine.sampling_params import RequestError

if TYPE_CHECKING:  # the engine imports torch's side (its runner): named for the type checker only
    from kvfleet.engine.core.engine import Engine

log = logging.getLogger(__name__)


EngineFactory = Callable[[], "Engine"]  # picklable: a module-level function or a functools.partial of one

Receive = Callable[[float], list[Command]]  # waits up to that many seconds; what arrived, maybe nothing
Send = Callable[[StepBatch], None]


class CoreLoop:
    """The engine with its inbox applied between steps: :meth:`run` is the loop every transport runs."""

    def __init__(
        self, engine: Engine, clock: Callable[[], float] = time.monotonic, idle_wait_s: float = 0.5
    ) -> None:
        self.engine = engine
        self._clock = clock
        self._idle_wait_s = idle_wait_s
        self._verdicts: list[Verdict] = []
        self._deltas: list[ReqDelta] = []
        self._embedded: list[Embedded] = []  # EmbedCmd answers (--runner pooling), made in apply
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
            elif isinstance(cmd, EmbedCmd):
                self._embedded.append(embed(self.engine, cmd))

    def _add(self, cmd: AddCmd) -> None:
        try:
            self.engine.add(cmd)
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
            self._clock(), self._step_started, self._verdicts, self._deltas, self.engine.stats(),
            embedded=self._embedded,
        )  # fmt: skip
        self._verdicts, self._deltas, self._step_started, self._embedded = [], [], None, []
        return batch

    def failed(self, exc: BaseException) -> StepBatch:
        """The last batch of a core whose engine raised: every stream fails with it."""
        log.error("engine core failed", exc_info=exc)
        return StepBatch(self._clock(), None, [], [], self.engine.stats(), f"the engine loop failed: {exc!r}")


# ---- the core process


def core_main(sock: socket.socket, factory: EngineFactory, parent_pid: int, idle_wait_s: float) -> None:
    """The core process's body: build the engine, greet, serve the link until told to stop or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process owns shutdown (drain first)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    link = BlockingLink(sock)
    try:
        engine = factory()
    except Exception as exc:  # a bad flag value, an unknown GPU/model, an unreadable checkpoint
        with contextlib.suppress(OSError):
            link.send(StartFailed(" ".join(str(exc).split())))
        return
    freeze_startup_heap()
    name = str(getattr(engine, "model_name", "model"))
    core = CoreLoop(engine, idle_wait_s=idle_wait_s)
    try:
        link.send(Hello(name, int(getattr(engine, "max_model_len", 0)), engine.stats()))
        core.run(_receiver(link, parent_pid), lambda batch: link.send(to_wire(batch)))
    except (EOFError, ConnectionError):
        return  # the API process is gone: nobody to serve
    except BaseException as exc:  # the engine is broken: tell the API side, which fails every stream
        with contextlib.suppress(OSError):
            link.send(to_wire(core.failed(exc)))


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, the model, the tokenizer: ~200k on SmolLM2) out
    of the cyclic collector's reach, as vLLM's and SGLang's engine cores do.

    Why: a full collection walks them all, 48 ms on SmolLM2's core, and lands inside whichever step
    allocated past the threshold: a TTFT or inter-token spike. They live as long as the process, so
    never scanning them loses nothing; what the steps allocate later is collected as before.
    """
    gc.collect()
    gc.freeze()


def _receiver(link: BlockingLink, parent_pid: int) -> Callable[[float], list[Command]]:
    """CoreLoop's receive over the link: what is waiting after up to ``timeout`` s of idling."""

    def receive(timeout: float) -> list[Command]:
        commands: list[Command] = []
        if link.poll(timeout):
            commands.append(link.recv())
            while link.poll(0):
                commands.append(link.recv())
        if os.getppid() != parent_pid:  # orphaned (the API process died without closing the link)
            commands.append(ShutdownCmd("the API process is gone"))
        return commands

    return receive
