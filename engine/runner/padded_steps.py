"""The decode-step path of the model runner: static buffers, padding to a served size, a graph runner.

Where it sits: ``ModelRunner.launch`` runs here the steps the step dispatcher
(``engine/runner/step_dispatch.py``, over :meth:`DecodePath.caps`) padded to one of its sizes: a pure
decode step (every scheduled sequence one new token and sampling, no LoRA adapter) that fits the
buffers, on the ``graph`` route or, through the plain call, ``native`` or ``per_op``; the others
run unpadded (:meth:`StepBuffers.fill_plan`). The step's values go into the runner's one
:class:`StepBuffers` with one host-to-device copy (none on the CPU, whose views are the host's),
the batch is padded up to one of the graph runner's sizes (padding rows
write the null block the runner reserves past the scheduler's blocks), and the graph runner
(:mod:`kvfleet.engine.runner.cuda_graphs`) replays the captured forward, or on the CPU calls it.

:func:`decode_setup` decides, before the KV cache is sized, whether this engine takes the path
and with which runner: none at tensor parallelism > 1 nor with dynamic rope (its frequencies are
read on the host per step); CUDA graphs on CUDA with the ``triton`` backend unless
``enforce_eager`` (the ``torch`` backend plans its padded SDPA calls from the metadata read on
the host, which a capture cannot hold; ``cpu`` is CPU-only); the plain call otherwise, padded to
``cuda_graph_sizes`` when given (tests do, to run the padding on the CPU), else unpadded.
LoRA steps run eagerly (the adapter context is per row and per step).

Graph memory, on CUDA: :meth:`DecodeSetup.measure` captures every size once against a one-block
throw-away KV cache before the cache is sized, measures the device memory the capture took
(``torch.cuda.mem_get_info``, so the driver's share is in it), frees it, and the runner adds it to
the ``used`` bytes :func:`kvfleet.engine.runner.model_runner.gpu_kv_budget` is given; the real capture follows
the KV allocation (a graph holds the cache's addresses).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvfleet.engine.attention import AttentionBackend
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.fused_layers import NativeStep
from kvfleet.engine.model.rope_scaling import rope_is_dynamic
from kvfleet.engine.runner.cuda_graphs import (
    CudaGraphs,
    EagerCalls,
    GraphRunner,
    PaddedStep,
    capture_sizes,
)
from kvfleet.engine.runner.launched_step import PickedStep
from kvfleet.engine.runner.step_buffers import StepBuffers
from kvfleet.engine.runner.step_dispatch import RunnerCaps
from kvfleet.engine.sched.plan import SchedulerPlan

if TYPE_CHECKING:
    from kvfleet.engine.model.llama import LlamaForCausalLM


class DecodePath:
    """Decode steps of ``model`` over ``kv_caches`` through static buffers and a graph runner."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        buffers: StepBuffers,
        graphs: GraphRunner,
        max_model_len: int,
    ) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.buffers, self.graphs = buffers, graphs
        buffers.frozen = isinstance(graphs, CudaGraphs)  # the graphs hold the buffers' addresses
        full_width = buffers.layout.max_blocks
        with torch.inference_mode():
            graphs.prepare(self._forward, lambda rows: PaddedStep(rows, full_width, max_model_len))

    def _forward(self, shape: PaddedStep) -> torch.Tensor:
        batch = self.buffers.batch(shape.rows, shape.width, (), shape.max_seq_len)
        return self.model(
            batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.backend, batch.sample_rows,
            native=shape.native,
        )  # fmt: skip

    def run(
        self, plan: SchedulerPlan, rows: int, native: bool, fed: PickedStep | None = None
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """(logits of the sampling rows, their seq ids) of a decode step the dispatcher padded to
        ``rows``, a size of the graph runner; ``native``: its layers in one native call (never on a
        captured graph). ``fed``: the previous step's tokens, for inputs still placeholders on the host."""
        scheduled = plan.scheduled
        self.buffers.fill(scheduled, rows, fed)
        width = max(len(s.block_ids) for s in scheduled)
        max_seq_len = max(s.num_computed_before for s in scheduled) + 1
        logits = self.graphs.run(PaddedStep(rows, width, max_seq_len, native))
        return logits[: len(scheduled)], tuple(s.seq.seq_id for s in scheduled)

    def caps(self, native: NativeStep | None, no_native: str) -> RunnerCaps:
        """The dispatcher's view of this path: its sizes, captured or not, beside the native step."""
        graphs = isinstance(self.graphs, CudaGraphs)
        return RunnerCaps(self.graphs.sizes, self.buffers.layout.max_blocks, graphs, native, no_native)


@dataclass(frozen=True)
class DecodeSetup:
    """What the runner decided before the KV cache exists; :meth:`build` once it does."""

    sizes: tuple[int, ...]
    cuda_graphs: bool
    max_blocks: int  # block-table columns per row
    block_size: int
    max_model_len: int
    device: torch.device

    def runner(self) -> GraphRunner:
        return CudaGraphs(self.sizes, self.device) if self.cuda_graphs else EagerCalls(self.sizes)

    def build(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        buffers: StepBuffers,
    ) -> DecodePath:
        """The path over the runner's caches and step buffers, whose ``null_block`` no sequence owns."""
        return DecodePath(model, kv_caches, backend, buffers, self.runner(), self.max_model_len)

    def buffers(self, null_block: int, max_seqs: int = 0, max_tokens: int = 0) -> StepBuffers:
        """Step buffers of this path's sizes and block-table width (more sequences and rows if asked)."""
        seqs = max(self.sizes[-1], max_seqs)
        return StepBuffers(seqs, self.max_blocks, self.block_size, null_block, self.device, max_tokens)

    def measure(self, model: LlamaForCausalLM, backend: AttentionBackend, cache_shape: Sequence[int]) -> int:
        """Device bytes a capture of every size takes (0 without CUDA graphs): captured once over a
        one-block cache of ``cache_shape``'s other dimensions, measured, freed."""
        if not self.cuda_graphs:
            return 0
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        shape = (cache_shape[0], 1, *cache_shape[2:])
        dtype = next(model.parameters()).dtype
        caches = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in model.model.layers]
        path: DecodePath | None = self.build(model, caches, backend, self.buffers(null_block=0))
        torch.cuda.empty_cache()  # the warm-up's freed blocks: not the graphs' (their pool is held)
        taken = free_before - torch.cuda.mem_get_info(self.device)[0]
        del path, caches
        gc.collect()
        torch.cuda.empty_cache()
        return max(0, taken)


def decode_setup(
    config: EngineConfig, device: torch.device, backend: str, model_config: ModelConfig, max_model_len: int
) -> DecodeSetup | None:
    """Whether the engine takes the decode path, and with which graph runner (see the module's docstring)."""
    if config.tensor_parallel_size > 1 or rope_is_dynamic(model_config):
        return None
    cuda_graphs = device.type == "cuda" and backend == "triton" and not config.enforce_eager
    if cuda_graphs or config.cuda_graph_sizes:
        sizes = capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)
    else:  # a plain call for every batch size: no padding
        sizes = tuple(range(1, config.max_num_seqs + 1))
    max_blocks = -(-max_model_len // config.block_size) + 1
    return DecodeSetup(sizes, cuda_graphs, max_blocks, config.block_size, max_model_len, device)
