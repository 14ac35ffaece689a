"""A tensor-parallel worker: ranks 1..tp-1, each a process of its own, running the model's forward only.

Where it sits: rank 0 (``parallel/leader.py``, inside the engine core process) starts
``python -m kvfleet.engine.parallel.worker FD`` per rank with one end of a socket pair (the
control link, framed pickles as ``engine/link.py``) and sends a :class:`WorkerInit`. The
worker joins the process group (``parallel/group.py``), loads only its shard of the weights,
allocates its KV cache (its own KV heads, the block count rank 0 decided), says ready, then
serves the link: per step a header, then the inputs by broadcast (``parallel/step_inputs.py``)
and the forward, whose collectives meet rank 0's; LoRA register/unregister; shutdown. It never
samples and never sees the scheduler.

It never outlives rank 0: the link's EOF (rank 0's process died, even by SIGKILL: the kernel
closes its end), a failed collective (gloo: within the group's timeout) or a changed parent pid
(checked every half second) ends it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.engine.attention import get_backend
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kv.groups import kv_layout
from kvfleet.engine.layers.linear.config import QuantizationConfig
from kvfleet.engine.link import BlockingLink
from kvfleet.engine.loader.registry import load_for
from kvfleet.engine.lora.manager import LoraManager
from kvfleet.engine.model.kv_tensors import layer_kv_caches
from kvfleet.engine.parallel.group import TPComm, join_group, join_store, leave_group
from kvfleet.engine.parallel.shard import RankShard, lora_slices
from kvfleet.engine.parallel.step_inputs import StepHeader, unpack

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class WorkerInit:
    """Everything a worker needs, decided by rank 0 (so every rank runs the same model the same way)."""

    config: EngineConfig
    quantization: QuantizationConfig  # rank 0's, resolved once: every rank loads its linears alike
    model_path: str
    shard: RankShard
    port: int  # rank 0's TCPStore
    device: str  # this rank's: cpu, or cuda:<rank>
    dtype: str  # a key of _DTYPES
    backend: str  # the attention backend rank 0 resolved
    weight_packing: str | None  # the packer rank 0 chose (None: none)
    threads: int  # torch's CPU threads for this rank
    vocab_sizes: list[int]
    parent_pid: int
    timeout_s: float


class RankWorker:
    """One worker rank: its model shard, its KV cache, its adapters' shards."""

    def __init__(self, init: WorkerInit) -> None:
        torch.set_num_threads(init.threads)
        self.init = init
        shard, world = init.shard, init.shard.tp_size
        self.device, self.dtype = torch.device(init.device), _DTYPES[init.dtype]
        join_group(
            join_store(init.port, world, init.timeout_s), shard.rank, world, self.device, init.timeout_s
        )
        self.comm = TPComm(shard.rank, world, init.vocab_sizes)
        path = Path(init.model_path)
        self.model = load_for(init.quantization, init.model_path, path, self.dtype, self.device, shard)
        if init.weight_packing is not None:
            self.model.prepack(init.weight_packing)
        self.model.comm = self.comm
        self.backend = get_backend(init.backend)
        self.kv_caches: list[torch.Tensor] = []
        self.lora: LoraManager | None = None
        config, model_config = init.config, self.model.config
        if config.lora_enabled:
            self.lora = LoraManager.for_engine(
                config, model_config, self.device, self.dtype, lora_slices(shard, model_config.head_dim)
            )

    def allocate_kv(self, num_blocks: int) -> None:
        kv_heads = self.init.shard.kv_heads.size
        shape = (2, num_blocks, self.init.config.block_size, kv_heads, self.model.config.head_dim)
        config = self.model.config
        layout = kv_layout(config.layer_windows, config.num_layers)  # as rank 0's
        self.kv_caches = layer_kv_caches(layout, shape, self.dtype, self.device)

    def step(self, header: StepHeader) -> None:
        flat = torch.empty(header.numel, dtype=torch.int64, device=self.device)
        self.comm.broadcast(flat)
        batch, token_slots = unpack(header, flat)
        meta = batch.meta
        if header.lora is not None and self.lora is not None:
            assert token_slots is not None
            self.lora.pin(header.lora)
            meta = dataclasses.replace(meta, lora=self.lora.context_for_slots(token_slots))
        with torch.inference_mode():
            self.model(
                batch.input_ids, batch.positions, self.kv_caches, meta, self.backend, batch.sample_rows
            )

    def serve(self, link: BlockingLink) -> None:
        """Apply rank 0's messages until told to stop; the link's EOF raises (rank 0 is gone)."""
        while True:
            msg = link.recv()
            kind = msg[0]
            if kind == "step":
                self.step(msg[1])
            elif kind == "lora_load" and self.lora is not None:
                self.lora.register(msg[1], msg[2])
            elif kind == "lora_unload" and self.lora is not None:
                self.lora.unregister(msg[1])
            elif kind == "kv":
                self.allocate_kv(msg[1])
                link.send(("ready",))
            elif kind == "shutdown":
                return


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)  # orphaned: rank 0's process is gone


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    link = BlockingLink(socket.socket(fileno=int(args[0])))
    init: WorkerInit = link.recv()
    threading.Thread(target=_watch_parent, args=(init.parent_pid,), daemon=True).start()
    try:
        worker = RankWorker(init)
    except Exception as exc:  # tell rank 0 why, which fails the engine's start with it
        link.send(("failed", f"tensor-parallel rank {init.shard.rank}: {exc}"))
        return 1
    try:
        worker.serve(link)
    except ConnectionError:
        return 0  # rank 0 is gone: nobody to serve
    finally:
        leave_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
