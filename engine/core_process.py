"""The engine core in its own process (as vLLM v1's EngineCore, SGLang's scheduler process).

Where it sits: ``kvfleet engine`` (the API process: FastAPI, tokenising, SSE) launches
:class:`ProcessCore`, which spawns :func:`core_main`. The child builds the ``Engine`` from
a picklable factory, says :class:`Hello`, then runs :meth:`~kvfleet.engine.core.CoreLoop.run`
(the loop ``ThreadCore`` runs too): commands arrive over a socket pair (framed pickles,
``engine/core_link.py``) and are applied between steps; after each step one
:class:`~kvfleet.engine.core.StepBatch` goes back (as plain tuples, :func:`to_wire`) with
every sequence's new tokens and the stats that ``/load`` and ``/metrics`` show. The API process drives its end from the event loop
(:class:`~kvfleet.engine.core_link.AsyncLink`): reads and writes never block it, a full
socket buffer is a wait and never an error, and the model step holds a GIL of its own.

Lifetime: the core ignores SIGINT and SIGTERM (the API process drains, then sends
:class:`~kvfleet.engine.core.ShutdownCmd`). It exits when told to, when the link reaches
EOF (the API process died, even by SIGKILL: the kernel closes its end), or when its parent
pid changes (it was orphaned), so it never outlives the server. The API process declares
the core dead only when it is: its process exited (its sentinel) or the link closed; it
then logs why at ERROR and fails every request in flight (``engine/server/serve.py`` then
exits non-zero so that the Deployment or ``kvfleet up`` restarts the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
from collections.abc import Callable
from typing import Any, NamedTuple

from kvfleet.engine.core import (
    Command,
    CoreLoop,
    Deliver,
    EngineLike,
    ShutdownCmd,
    StepBatch,
    Verdict,
)
from kvfleet.engine.core_link import AsyncLink, BlockingLink, LinkClosed
from kvfleet.engine.outputs import EngineStats, ReqDelta, SeqDelta
from kvfleet.oslib import describe_exit

log = logging.getLogger(__name__)
EngineFactory = Callable[[], EngineLike]  # picklable: a module-level function or a functools.partial of one


class Hello(NamedTuple):
    """The core is up: what the API process needs to serve it."""

    model_name: str
    max_model_len: int
    stats: EngineStats


class StartFailed(NamedTuple):
    message: str  # the factory's ValueError / OSError, on one line


class CoreStartError(ValueError):
    """The core process could not build its engine (a bad flag, an unreadable checkpoint)."""


# ---- the wire: a StepBatch as plain tuples
# Pickling a NamedTuple calls back into Python once per object (its __getnewargs__); plain
# tuples pickle in C. For a 32-sequence decode step that is 113 -> 39 us in the core, where
# every microsecond is one the model step does not get (timeit, 32 one-token deltas).
WireBatch = tuple[Any, ...]


def to_wire(b: StepBatch) -> WireBatch:
    deltas = [(d[0], d[1], d[2], d[3], [tuple(s) for s in d[4]]) for d in b.deltas]
    return (b.now, b.step_started, [tuple(v) for v in b.verdicts], deltas, b.stats, b.error)


def from_wire(w: WireBatch) -> StepBatch:
    now, started, verdicts, deltas, stats, error = w
    return StepBatch(
        now,
        started,
        [Verdict(*v) for v in verdicts],
        [ReqDelta(r, f, p, c, [SeqDelta(*s) for s in seqs]) for r, f, p, c, seqs in deltas],
        stats,
        error,
    )


# ---- the child


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


# ---- the API process's handle


class ProcessCore:
    """Spawns and talks to the core process; a ``CoreTransport`` for ``AsyncEngine``."""

    def __init__(
        self, factory: EngineFactory, *, idle_wait_s: float = 0.5, start_timeout_s: float = 600.0
    ) -> None:
        self._factory = factory
        self._idle_wait_s = idle_wait_s
        self._start_timeout_s = start_timeout_s
        self._proc: Any = None  # multiprocessing.context.SpawnProcess
        self._link: BlockingLink | None = None
        self._async: AsyncLink | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Deliver | None = None
        self._dead = False
        self.hello: Hello | None = None
        self.death: str | None = None  # why the core is gone, once it is

    @property
    def initial_stats(self) -> EngineStats:
        return self.launch().stats

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else int(self._proc.pid)

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._dead and self._proc.is_alive()

    def launch(self) -> Hello:
        """Start the process and wait until its engine is built (blocking; before the server starts)."""
        if self.hello is not None:
            return self.hello
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads, locks or CUDA state
        ours, theirs = socket.socketpair()
        args = (theirs, self._factory, os.getpid(), self._idle_wait_s)
        self._proc = ctx.Process(target=core_main, args=args, name="kvfleet-engine-core", daemon=True)
        self._proc.start()
        theirs.close()  # only the child holds that end now: its death is our EOF, and ours its EOF
        self._link = BlockingLink(ours)
        msg = self._first_message(self._link)
        if isinstance(msg, StartFailed):
            self._proc.join(5)
            raise CoreStartError(msg.message)
        self.hello = msg
        return msg

    def _first_message(self, link: BlockingLink) -> Hello | StartFailed:
        try:
            if not link.poll(self._start_timeout_s):
                self._kill()
                raise CoreStartError(f"the engine core did not start within {self._start_timeout_s:.0f} s")
            msg: Hello | StartFailed = link.recv()
        except LinkClosed:
            self._proc.join(5)
            raise CoreStartError(
                f"the engine core process ended while starting ({describe_exit(self._proc.exitcode)})"
            ) from None
        return msg

    def start(self, deliver: Deliver, loop: asyncio.AbstractEventLoop) -> None:
        self.launch()
        assert self._link is not None
        self._deliver, self._loop = deliver, loop
        self._async = AsyncLink(self._link, loop, self._on_message, self._on_closed)
        loop.add_reader(self._proc.sentinel, self._on_exit)

    def _on_message(self, wire: WireBatch) -> None:
        assert self._deliver is not None
        self._deliver(from_wire(wire))

    def _on_closed(self, reason: str) -> None:
        self._lost(f"its link closed ({reason})")

    def _on_exit(self) -> None:
        if self._async is not None:
            self._async.read_ready()  # its last words (a failed step's error) before the exit
        self._lost("its process ended")

    def _lost(self, how: str) -> None:
        """The core is gone (its process ended or its link closed): say why, fail everything once."""
        if self._dead:
            return
        self._dead = True
        self._detach()
        if self._proc is not None:
            self._proc.join(1)
        code = None if self._proc is None else self._proc.exitcode
        self.death = f"the engine core process died: {how}, {describe_exit(code)}"
        log.error("%s; failing every request in flight", self.death)
        if self._deliver is not None:
            stats = self.hello.stats if self.hello is not None else None
            self._deliver(StepBatch(0.0, None, [], [], stats, self.death))

    def send(self, command: Command) -> None:
        """Queue a command for the core (never blocks, never fails on a full buffer)."""
        if self._async is not None and not self._dead:
            self._async.send(command)

    def stop(self, timeout: float = 5.0) -> None:
        """Shut the core down (it finishes its step first); terminate it if it does not go in time."""
        if self._proc is None:
            return
        if not self._dead:
            self._dead = True
            if self._async is not None:
                self._async.finish(ShutdownCmd(), timeout=1.0)
            elif self._link is not None:
                with contextlib.suppress(OSError):
                    self._link.send(ShutdownCmd())
        self._detach()
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine core did not stop in %.1f s: terminating it", timeout)
            self._kill()
        if self._link is not None:
            self._link.sock.close()
            self._link = None

    def _detach(self) -> None:
        if self._async is not None:
            self._async.detach()
        if self._loop is not None and self._proc is not None and not self._loop.is_closed():
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._proc.sentinel)

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.join(5)
