"""The usage log: one JSON line per finished request, for billing and audits (docs/architecture.md §8).

Where it sits: :meth:`kvfleet.router.accounting.Exchange.finish` settles every admitted request
exactly once, on both transports (the HTTP relay and the Envoy ext_proc path), and hands
:meth:`~kvfleet.router.accounting.Exchange.usage_record` of it to the process's :class:`UsageLog` (``--usage-log PATH``, ``-`` for
stdout; none by default). A record names the tenant, the model (and adapter), the engine, the
prompt, cached and output tokens, the queue wait, TTFT and duration, the status and finish
reason, and the trace id when tracing is on; never the prompt, the output or a key.

The request path never blocks on the disk: :meth:`UsageLog.write` puts the line on a bounded
queue that one writer thread drains (a full queue drops the record, counted in
``kvfleet_router_usage_records_dropped_total`` and logged). The file rotates by size: before
a line would take it past ``max_bytes``, it is closed, renamed ``PATH.1`` (older ones shift to
``PATH.2`` ... ``PATH.<backups>``) and reopened, so no line is split across two files.
:meth:`UsageLog.close` (the router's shutdown, after its streams finished) writes what is
queued and flushes it.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from pathlib import Path
from typing import IO, Any

import orjson

log = logging.getLogger(__name__)

STDOUT = "-"
_STOP = b""  # the sentinel that ends the writer thread


class UsageLogError(ValueError):
    """The usage log cannot be written: names the path and why."""


def check_writable(path: str) -> None:
    """Raise :class:`UsageLogError` naming ``path`` unless records can be appended to it."""
    if path == STDOUT:
        return
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise UsageLogError(f"--usage-log {path}: cannot open for writing: {exc.strerror}") from None


def seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class UsageLog:
    """A background writer of JSON lines to ``path`` (``-``: stdout), rotated at ``max_bytes`` (0: never)."""

    def __init__(self, path: str, max_bytes: int = 0, backups: int = 5, queue_size: int = 65536) -> None:
        if max_bytes < 0 or backups < 0 or queue_size < 1:
            raise UsageLogError("--usage-log-max-bytes and --usage-log-backups must be >= 0")
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self.dropped = 0
        self.on_drop: list[Any] = []  # callables, each called once per dropped record
        self._queue: queue.Queue[bytes] = queue.Queue(maxsize=queue_size)
        self._file, self._size = self._open()
        self._thread = threading.Thread(target=self._run, name="usage-log", daemon=True)
        self._thread.start()

    def _open(self) -> tuple[IO[bytes], int]:
        if self.path == STDOUT:
            return sys.stdout.buffer, 0
        try:
            f = open(self.path, "ab")  # noqa: SIM115 - held open by the writer thread
        except OSError as exc:
            raise UsageLogError(f"--usage-log {self.path}: cannot open for writing: {exc.strerror}") from None
        return f, os.fstat(f.fileno()).st_size

    def write(self, record: dict[str, Any]) -> None:
        """Queue one record (never blocks; a full queue drops it, counted)."""
        try:
            self._queue.put_nowait(orjson.dumps(record) + b"\n")
        except queue.Full:
            self.dropped += 1
            for hook in self.on_drop:
                hook()
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("usage log queue full: %d records dropped so far", self.dropped)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write everything queued, flush, close (idempotent)."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            log.error("usage log %s: the writer is stuck; records still queued are lost", self.path)
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        stop = False
        while not stop:
            lines = [self._queue.get()]
            while True:  # everything already queued goes out in one flush
                try:
                    lines.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in lines
            for line in lines:
                if line:
                    self._put(line)
            self._flush()
        if self.path != STDOUT:
            self._file.close()

    def _put(self, line: bytes) -> None:
        if self.max_bytes and self.path != STDOUT and self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
        try:
            self._file.write(line)
            self._size += len(line)
        except OSError as exc:
            log.error("usage log %s: cannot write a record: %s", self.path, exc)

    def _flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            log.error("usage log %s: cannot flush: %s", self.path, exc)

    def _rotate(self) -> None:
        """PATH → PATH.1 (PATH.1 → PATH.2 ..., the oldest beyond ``backups`` removed), then a new PATH."""
        self._flush()
        self._file.close()
        try:
            if self.backups == 0:
                Path(self.path).unlink(missing_ok=True)
            for i in range(self.backups - 1, 0, -1):
                older = Path(f"{self.path}.{i}")
                if older.exists():
                    older.replace(f"{self.path}.{i + 1}")
            if self.backups:
                Path(self.path).replace(f"{self.path}.1")
        except OSError as exc:
            log.error("usage log %s: cannot rotate: %s", self.path, exc)
        try:
            self._file = open(self.path, "ab")  # noqa: SIM115
        except OSError as exc:  # nowhere to write: records are dropped (logged) rather than the thread dying
            log.error("usage log %s: cannot reopen after rotating: %s", self.path, exc)
            self._file = open(os.devnull, "ab")  # noqa: SIM115
        self._size = os.fstat(self._file.fileno()).st_size
