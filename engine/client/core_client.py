"""The API side of the engine core: how the API process reaches the loop that runs the ``Engine``.

Where it sits: ``AsyncEngine`` (``engine/client/async_engine.py``) holds a :class:`CoreTransport`;
``kvfleet engine`` (``engine/cli.py``) picks one: :class:`ProcessCore` (the default) spawns
:func:`~kvfleet.engine.core.loop.core_main` as a process of its own (as vLLM v1's EngineCore,
SGLang's scheduler process) and talks to it over a socket pair, so the model step holds a
GIL of its own; :class:`ThreadCore` (tests, ``--engine-core thread``) runs the same
:class:`~kvfleet.engine.core.loop.CoreLoop` in a thread of this process. Either way commands go
in and per-step :class:`~kvfleet.engine.core.messages.StepBatch` values come back on the event
loop (``engine/core/messages.py`` holds what crosses).

:class:`ProcessCore` drives its end of the link from the event loop
(:class:`~kvfleet.engine.link.AsyncLink`): reads and writes never block it, and a full
socket buffer is a wait, never an error. It declares the core dead only when it is: its
process exited (its sentinel) or the link closed; it then logs why at ERROR and fails every
request in flight (``engine/server/serve.py`` then exits non-zero so that the Deployment or
``kvfleet up`` restarts the engine). Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvfleet.engine.core.loop import CoreLoop, EngineFactory, core_main
from kvfleet.engine.core.messages import (
    Command,
    Hello,
    ShutdownCmd,
    StartFailed,
    StepBatch,
    WireBatch,
    from_wire,
)
from kvfleet.engine.link import AsyncLink, BlockingLink, LinkClosed
from kvfleet.engine.outputs import EngineStats
from kvfleet.oslib import describe_exit

if TYPE_CHECKING:  # the engine core's side: named for the type checker only
    from kvfleet.engine.core.engine import Engine

log = logging.getLogger(__name__)


class CoreStartError(ValueError):
    """The core process could not build its engine (a bad flag, an unreadable checkpoint)."""


Deliver = Callable[[StepBatch], None]


class CoreTransport(Protocol):
    """How the API side reaches a core: :class:`ThreadCore` (a thread) or :class:`ProcessCore` (a process)."""

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
        self, engine: Engine, *, clock: Callable[[], float] = time.monotonic, idle_wait_s: float = 0.5
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
