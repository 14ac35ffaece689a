"""The tensor-parallel process group: set up and torn down with bounded waits, and its collectives.

Where it sits: rank 0 (the runner in the engine core process, ``parallel/leader.py``) opens a
``TCPStore`` on a free localhost port (:func:`open_store`, port 0: the kernel picks it) and hands
the port to its workers (``parallel/worker.py``); every rank then calls :func:`join_group`. gloo on
the CPU, NCCL on CUDA (rank r on ``cuda:r``). ``timeout_s`` bounds the group's set-up and, with
gloo, every collective: a rank that dies mid-step makes the others' next collective fail within
it, never hang. :class:`TPComm` is the model's ``Collective`` (``engine/model/tp.py``).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

HOST = "127.0.0.1"


def open_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a free localhost port (``store.port``)."""
    return dist.TCPStore(
        HOST,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        HOST, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(
    store: dist.TCPStore, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> None:
    """Join the default process group (blocks until every rank has, at most ``timeout_s``)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class TPComm:
    """The model's collectives over the default group (``engine/model/tp.py``'s ``Collective``)."""

    def __init__(self, rank: int, world_size: int, vocab_sizes: list[int]) -> None:
        self.rank, self.world_size = rank, world_size
        self.vocab_sizes = vocab_sizes  # each rank's vocabulary slice, rank 0 first
        self.reduces = 0  # all-reduces run, and their wall time here (waiting for the slower rank included)
        self.reduce_seconds = 0.0

    def all_reduce(self, x: torch.Tensor) -> None:
        start = time.perf_counter()
        dist.all_reduce(x)
        self.reduce_seconds += time.perf_counter() - start
        self.reduces += 1

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Each rank's (rows, its slice) padded to the widest slice and gathered on rank 0, unpadded there."""
        width = max(self.vocab_sizes)
        rows = local.shape[0]
        padded = local
        if local.shape[1] < width:
            padded = torch.zeros((rows, width), dtype=local.dtype, device=local.device)
            padded[:, : local.shape[1]] = local
        if self.rank != 0:
            dist.gather(padded.contiguous(), None, dst=0)
            return local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.gather(padded.contiguous(), parts, dst=0)
        return torch.cat([p[:, :n] for p, n in zip(parts, self.vocab_sizes, strict=True)], dim=1)

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's ``x`` into every rank's ``x`` (a step's inputs, ``parallel/step_inputs.py``)."""
        dist.broadcast(x, src=0)
