"""CUDA graphs for decode steps, behind a ``GraphRunner`` interface whose CPU implementation is a plain call.

Where it sits: :mod:`kvfleet.engine.runner.padded_steps` hands a graph runner its forward (the model over the
static step buffers of :mod:`kvfleet.engine.runner.step_buffers`, for a given row count) once, then asks it
to ``run`` each decode step padded to one of its ``sizes``. :class:`CudaGraphs` captures the forward
once per size and replays it: a Llama-3-8B decode step is ~700 kernel launches, which the host
issues slower than an H200 runs them (issue #30: 13% GPU-busy on SmolLM2, 24.7% MBU at batch 1).
:class:`EagerCalls` (the CPU, ``--enforce-eager``, the torch attention backend) calls the forward:
the same buffers, padding and views, with capture and replay swapped for a call, so CI runs the
graph path's code on the CPU. Which of them runs a step is the step dispatcher's choice
(``engine/runner/step_dispatch.py``: ``graph`` where the sizes are captured, else ``native`` or ``per_op``
through the plain call).

Only decode steps are captured: a graph fixes every tensor's shape, and a prefill or mixed step's
token count, query lengths and prompt-chunk layout change every step (vLLM's answer, piecewise
graphs, captures the layers between the attention calls for token-count buckets and runs attention
eagerly; not done here). Those steps run unpadded (``engine/runner/step_dispatch.py`` routes them).

Sizes as vLLM's ``cudagraph_capture_sizes``: 1, 2, 4, then every multiple of 8, up to
``max_num_seqs`` (which is captured too) and at most 512; a decode batch larger than the largest
size runs eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

MAX_CAPTURE_SIZE = 512


class PaddedStep(NamedTuple):
    """What a forward over the static buffers needs besides their values (``StepShape`` in
    ``engine/sched/step_cost.py`` is another thing: a plan's token counts for the cost model)."""

    rows: int  # the padded row count: a captured size
    width: int  # block-table columns the attention reads
    max_seq_len: int
    native: bool = False  # the layers in one native call (the step dispatcher's route; never captured)


Forward = Callable[[PaddedStep], torch.Tensor]  # float32 logits (rows, vocab), from the static buffers


def capture_sizes(max_num_seqs: int, requested: Sequence[int] | None = None) -> tuple[int, ...]:
    """The decode batch sizes served: ``requested`` (vLLM's ``cuda_graph_sizes``) or vLLM's default list."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    if requested:
        sizes = {s for s in requested if 1 <= s <= max_num_seqs}
        if not sizes:
            raise ValueError(f"cuda_graph_sizes {list(requested)}: none in 1..max_num_seqs={max_num_seqs}")
        return tuple(sorted(sizes))
    return tuple(sorted({s for s in (1, 2, 4, *range(8, top, 8)) if s <= top} | {top}))


def padded_size(sizes: Sequence[int], rows: int) -> int | None:
    """The smallest size that holds ``rows`` rows (None: none does; the step runs eagerly)."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


class GraphRunner(Protocol):
    sizes: tuple[int, ...]  # ascending

    def prepare(self, forward: Forward, full: Callable[[int], PaddedStep]) -> None:
        """Take the forward; a capturing runner captures ``forward(full(rows))`` for every size."""

    def run(self, shape: PaddedStep) -> torch.Tensor:
        """The forward's logits over the buffers as they are now, ``shape.rows`` rows."""


class EagerCalls:
    """Each run is a call of the forward at the step's own width: the CPU's graph runner."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(sizes)
        self._forward: Forward | None = None

    def prepare(self, forward: Forward, full: Callable[[int], PaddedStep]) -> None:
        self._forward = forward

    def run(self, shape: PaddedStep) -> torch.Tensor:
        assert self._forward is not None, "prepare() first"
        return self._forward(shape)


class CudaGraphs:
    """One captured graph per size, all in one memory pool; a run replays the step's size."""

    def __init__(self, sizes: Sequence[int], device: torch.device) -> None:
        self.sizes = tuple(sizes)
        self.device = device
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    # Invariant: the graphs are captured largest first into one pool, so every smaller graph's
    # intermediates fit in memory the largest already holds; a graph's output is read before the
    # next replay (the sampler's synchronisation), since another graph may reuse its memory.
    def prepare(self, forward: Forward, full: Callable[[int], PaddedStep]) -> None:
        order = sorted(self.sizes, reverse=True)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, cuBLAS picks kernels
            for rows in order:
                forward(full(rows))
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = None
        for rows in order:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[rows] = forward(full(rows))
            pool = graph.pool() if pool is None else pool
            self._graphs[rows] = graph
        torch.cuda.synchronize(self.device)

    def run(self, shape: PaddedStep) -> torch.Tensor:
        self._graphs[shape.rows].replay()
        return self._outputs[shape.rows]
