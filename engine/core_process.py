"""The engine core in its own process (as vLLM v1's EngineCore, SGLang's scheduler process).

Where it sits: ``kvfleet engine`` (the API process: FastAPI, tokenising, SSE) launches
:class:`ProcessCore`, which spawns :func:`core_main`. The child builds the ``Engine`` from
a picklable factory, says :class:`Hello`, then runs :class:`~kvfleet.engine.core.CoreLoop`:
commands arrive over a ``multiprocessing`` pipe (pickled NamedTuples) and are applied
between steps; after each step one :class:`~kvfleet.engine.core.StepBatch` goes back (as
plain tuples, :func:`to_wire`) with
every sequence's new tokens and the stats that ``/load`` and ``/metrics`` show. The API
process reads the pipe from its event loop (``loop.add_reader``), so no thread of its own
ever waits on the engine, and the model step holds a GIL of its own.

Lifetime: the core ignores SIGINT and SIGTERM (the API process drains, then sends
:class:`~kvfleet.engine.core.ShutdownCmd`). It exits when told to, when the pipe reaches
EOF (the API process died, even by SIGKILL: the kernel closes its end), or when its parent
pid changes (it was orphaned), so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from kvfleet.engine.core import (
    AbortCmd,
    AddCmd,
    Command,
    CoreLoop,
    Deliver,
    EngineLike,
    ReqDelta,
    SeqDelta,
    ShutdownCmd,
    StepBatch,
    Verdict,
)

log = logging.getLogger(__name__)
EngineFactory = Callable[[], EngineLike]  # picklable: a module-level function or a functools.partial of one


class Hello(NamedTuple):
    """The core is up: what the API process needs to serve it."""

    model_name: str
    max_model_len: int
    stats: Any  # EngineStats


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


def core_main(conn: Connection, factory: EngineFactory, parent_pid: int, idle_wait_s: float) -> None:
    """The core process's body: build the engine, greet, serve the pipe until told to stop or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process owns shutdown (drain first)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = factory()
    except Exception as exc:  # a bad flag value, an unknown GPU/model, an unreadable checkpoint
        conn.send(StartFailed(" ".join(str(exc).split())))
        return
    name = str(getattr(engine, "model_name", "model"))
    conn.send(Hello(name, int(getattr(engine, "max_model_len", 0)), engine.stats()))
    core = CoreLoop(engine)
    try:
        serve_pipe(conn, core, parent_pid, idle_wait_s)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the API process is gone: nobody to serve
    except BaseException as exc:  # the engine is broken: tell the API side, which fails every stream
        log.exception("engine core failed")
        with contextlib.suppress(OSError):
            conn.send(to_wire(core.failed(exc)))


# Invariant: commands are applied in the order sent, only between steps; one batch per step.
def serve_pipe(conn: Connection, core: CoreLoop, parent_pid: int, idle_wait_s: float) -> None:
    while (commands := _receive(conn, 0.0 if core.has_work else idle_wait_s)) is not None:
        if os.getppid() != parent_pid:
            return  # orphaned (the API process died without closing the pipe): exit rather than linger
        core.apply(commands)
        if core.has_verdicts and core.has_work:
            conn.send(to_wire(core.take_batch()))  # a verdict (400 or go) should not wait for a long step
        if core.has_work:
            core.step()
            conn.send(to_wire(core.take_batch()))
        elif commands:
            conn.send(to_wire(core.take_batch()))  # aborts and refusals change the stats too


def _receive(conn: Connection, timeout: float) -> list[AddCmd | AbortCmd] | None:
    """Whatever commands are waiting (after up to ``timeout`` s of idling); None on shutdown."""
    commands: list[AddCmd | AbortCmd] = []
    if not conn.poll(timeout):
        return commands
    while True:
        msg = conn.recv()
        if isinstance(msg, ShutdownCmd):
            return None
        commands.append(msg)
        if not conn.poll(0):
            return commands


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
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Deliver | None = None
        self._dead = False
        self.hello: Hello | None = None

    @property
    def initial_stats(self) -> Any:
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
        conn, child_conn = ctx.Pipe(duplex=True)
        args = (child_conn, self._factory, os.getpid(), self._idle_wait_s)
        self._proc = ctx.Process(target=core_main, args=args, name="kvfleet-engine-core", daemon=True)
        self._proc.start()
        child_conn.close()  # only the child holds that end now: its death is our EOF, and ours its EOF
        self._conn = conn
        msg = self._first_message(conn)
        if isinstance(msg, StartFailed):
            self._proc.join(5)
            raise CoreStartError(msg.message)
        self.hello = msg
        return msg

    def _first_message(self, conn: Connection) -> Hello | StartFailed:
        try:
            if not conn.poll(self._start_timeout_s):
                self._kill()
                raise CoreStartError(f"the engine core did not start within {self._start_timeout_s:.0f} s")
            msg: Hello | StartFailed = conn.recv()
        except EOFError:
            self._proc.join(5)
            raise CoreStartError(
                f"the engine core process exited with code {self._proc.exitcode} while starting"
            ) from None
        return msg

    def start(self, deliver: Deliver, loop: asyncio.AbstractEventLoop) -> None:
        self.launch()
        assert self._conn is not None
        self._deliver, self._loop = deliver, loop
        loop.add_reader(self._conn.fileno(), self._readable)

    def _readable(self) -> None:
        assert self._conn is not None and self._deliver is not None
        try:
            while self._conn.poll():
                self._deliver(from_wire(self._conn.recv()))
        except (EOFError, OSError):
            self._lost()

    def _lost(self) -> None:
        """The pipe closed under us: the core process died. Fail everything once."""
        if self._dead:
            return
        self._dead = True
        self._detach()
        if self._proc is not None:
            self._proc.join(1)
        code = None if self._proc is None else self._proc.exitcode
        if self._deliver is not None:
            stats = self.hello.stats if self.hello is not None else None
            self._deliver(
                StepBatch(0.0, None, [], [], stats, f"the engine core process exited (code {code})")
            )

    def send(self, command: Command) -> None:
        if self._conn is None or self._dead:
            return
        try:
            self._conn.send(command)
        except OSError:  # BrokenPipeError: the reader reports the death
            self._lost()

    def stop(self, timeout: float = 5.0) -> None:
        """Shut the core down (it finishes its step first); terminate it if it does not go in time."""
        if self._proc is None:
            return
        if not self._dead:
            self._dead = True
            with contextlib.suppress(OSError):
                assert self._conn is not None
                self._conn.send(ShutdownCmd())
        self._detach()
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine core did not stop in %.1f s: terminating it", timeout)
            self._kill()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _detach(self) -> None:
        if self._loop is not None and self._conn is not None and not self._loop.is_closed():
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._conn.fileno())

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.join(5)
