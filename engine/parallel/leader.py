"""Rank 0's side of tensor parallelism: start the workers, send them each step, watch them die.

Where it sits: inside ``ModelRunner`` (``engine/runner/model_runner.py``) when ``tensor_parallel_size`` > 1.
Rank 0 lives in the engine core process, which runs the scheduler once; :class:`Leader` spawns
one worker process per rank > 0 (``python -m kvfleet.engine.parallel.worker``, a child of the
core process: a daemonic multiprocessing child may not have children), opens the TCPStore,
joins the group with them, and per step sends a :class:`~kvfleet.engine.parallel.step_inputs.StepHeader`
on each worker's control link (a socket pair) and the inputs by one broadcast. LoRA
register/unregister reach every worker the same way. Only rank 0 samples.

Why a control link besides the group: a worker waits for the next step as long as the engine
idles (hours), which no collective may do under a timeout; the link's recv waits forever and
ends at rank 0's death (EOF). Every collective stays bounded by the group's timeout.

A dead worker takes the engine down: a thread per worker waits on it and, once the engine has
started, logs the exit and ends the core process with code 3 (``EXIT_WORKER_DEAD``), which the
API side reports as every core death (503 ``engine_dead``, exit 3). :meth:`close` stops them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading

import torch

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.layers.linear.config import QuantizationConfig
from kvfleet.engine.link import BlockingLink
from kvfleet.engine.model.batch import FlatBatch
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.parallel.group import TPComm, join_group, leave_group, open_store
from kvfleet.engine.parallel.shard import RankShard
from kvfleet.engine.parallel.step_inputs import pack
from kvfleet.engine.parallel.worker import WorkerInit

log = logging.getLogger(__name__)

EXIT_WORKER_DEAD = 3


class Leader:
    """Rank 0: the workers' processes, their control links and the group's collectives."""

    def __init__(self, inits: list[WorkerInit], device: torch.device, start_timeout_s: float) -> None:
        """Spawn a worker per init (ranks 1..), then join the group with them (blocks until all have)."""
        world = len(inits) + 1
        timeout_s = inits[0].timeout_s
        self._start_timeout_s = start_timeout_s
        self._store = open_store(world, timeout_s)
        self._closing, self._started = False, False
        self.procs: list[subprocess.Popen[bytes]] = []
        self.links: list[BlockingLink] = []
        for init in inits:
            ours, theirs = socket.socketpair()
            cmd = [sys.executable, "-m", "kvfleet.engine.parallel.worker", str(theirs.fileno())]
            self.procs.append(subprocess.Popen(cmd, pass_fds=(theirs.fileno(),)))
            theirs.close()  # only the worker holds that end: its death is our EOF, ours its EOF
            link = BlockingLink(ours)
            link.send(dataclasses.replace(init, port=self._store.port))
            self.links.append(link)
        for proc in self.procs:
            threading.Thread(target=self._watch, args=(proc,), daemon=True).start()
        try:
            join_group(self._store, 0, world, device, timeout_s)
        except Exception as exc:
            self.close()
            raise ModelLoadError(f"tensor parallelism: the process group did not form: {exc}") from exc
        self.comm = TPComm(0, world, inits[0].vocab_sizes)

    def start(self, num_blocks: int) -> None:
        """Tell every worker the KV block count; wait until each has loaded its shard and allocated."""
        for link in self.links:
            link.send(("kv", num_blocks))
        for rank, link in enumerate(self.links, start=1):
            try:
                if not link.poll(self._start_timeout_s):
                    raise ModelLoadError(
                        f"tensor-parallel rank {rank} did not start in {self._start_timeout_s} s"
                    )
                reply = link.recv()
            except ConnectionError:
                reply = ("failed", f"tensor-parallel rank {rank} exited while starting")
            if reply[0] != "ready":
                self.close()
                raise ModelLoadError(reply[1])
        self._started = True

    def send_step(
        self, batch: FlatBatch, lora: dict[str, int] | None, token_slots: torch.Tensor | None
    ) -> None:
        header, flat = pack(batch, lora, token_slots)
        for link in self.links:
            link.send(("step", header))
        self.comm.broadcast(flat)

    def mirror_lora(self, name: str, path: str | None) -> None:
        """Repeat an adapter's register (``path``) or unregister (None) on every worker."""
        msg = ("lora_unload", name) if path is None else ("lora_load", name, path)
        for link in self.links:
            link.send(msg)

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._closing or not self._started:
            return  # a worker that fails to start is reported by start()
        log.error(
            "tensor-parallel worker pid %d exited (code %s): the engine cannot step without it; exiting %d",
            proc.pid,
            code,
            EXIT_WORKER_DEAD,
        )
        logging.shutdown()
        os._exit(EXIT_WORKER_DEAD)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers (a shutdown message, then a kill past ``timeout_s``) and leave the group."""
        if self._closing:
            return
        self._closing = True
        for link in self.links:
            with contextlib.suppress(ConnectionError):
                link.send(("shutdown",))
            link.sock.close()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        leave_group()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:<rank>`` on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def spawn_workers(
    config: EngineConfig,
    quantization: QuantizationConfig,
    model_path: str,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    shards: list[RankShard],
    threads: int,
) -> Leader:
    """Start ranks 1.. of ``shards`` (each loading its own shard meanwhile) and join the group with them."""
    inits = [
        WorkerInit(
            config=config,
            quantization=quantization,
            model_path=model_path,
            shard=shard,
            port=0,
            device=str(rank_device(device, shard.rank)),
            dtype=str(dtype).removeprefix("torch."),
            backend=backend,
            weight_packing=config.weight_packing
            if config.prepack_weights and quantization.prepacks
            else None,
            threads=threads,
            vocab_sizes=[s.vocab.size for s in shards],
            parent_pid=os.getpid(),
            timeout_s=config.distributed_timeout_seconds,
        )
        for shard in shards[1:]
    ]
    return Leader(inits, rank_device(device, 0), start_timeout_s=600.0)
