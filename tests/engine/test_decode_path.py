"""The decode path (engine/runner/padded_steps.py: static step buffers, padding, a graph runner) against the
eager path (engine/model/batch.py's flatten_plan): the same greedy tokens, on the tiny model and SmolLM2,
with the CPU's graph runner (a plain call) standing in for CUDA graphs, and on CUDA the graphs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.model.batch import flatten_plan
from kvfleet.engine.runner.cuda_graphs import PaddedStep, capture_sizes, padded_size
from kvfleet.engine.runner.padded_steps import DecodePath
from kvfleet.engine.runner.step_buffers import StepBuffers
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SHARED = "kvfleet serves models on kubernetes and "  # a prefix the later prompts hit in the cache
PROMPTS = [SHARED + "more", "hi", SHARED + "then some", "the quick brown fox", "a", SHARED + "x", "zz"]


def test_capture_sizes_follow_vllms_list_up_to_max_num_seqs() -> None:
    assert capture_sizes(256)[:6] == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(256)[-1] == 256 and capture_sizes(10) == (1, 2, 4, 8, 10)
    assert capture_sizes(1024)[-1] == 512
    assert capture_sizes(64, [3, 1, 100]) == (1, 3)
    assert [padded_size((1, 2, 4, 8), n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]


def _decode_plan(block_size: int) -> SchedulerPlan:
    seqs = []
    for i, (prompt, out) in enumerate([([5, 6, 7], [8]), (list(range(1, 20)), [3, 4]), ([9], [])]):
        seq = Sequence(request_id=f"r{i}", prompt_token_ids=prompt, params=GREEDY, output_token_ids=out)
        start = seq.num_tokens - 1
        blocks = tuple(range(10 * i, 10 * i + start // block_size + 1))
        seqs.append(ScheduledSeq(seq, start, 1, blocks))
    return SchedulerPlan(scheduled=tuple(seqs))


def test_the_buffers_hold_what_flatten_plan_builds_and_padding_rows_hit_only_the_null_slot() -> None:
    plan = _decode_plan(block_size=4)
    eager = flatten_plan(plan, 4, torch.device("cpu"))
    buffers = StepBuffers(8, 8, 4, null_block=99, device=torch.device("cpu"))
    buffers.fill(plan.scheduled, 4)
    width = eager.meta.block_tables.shape[1]
    got = buffers.batch(4, width, eager.sample_seq_ids, eager.meta.max_seq_len)
    for name in ("input_ids", "positions", "sample_rows"):
        assert getattr(got, name)[:3].tolist() == getattr(eager, name).tolist(), name
    for name in ("slot_mapping", "seq_lens", "query_start_loc"):
        assert (
            getattr(got.meta, name)[: 3 + (name == "query_start_loc")].tolist()
            == getattr(eager.meta, name).tolist()
        )
    for r, s in enumerate(plan.scheduled):
        assert got.meta.block_tables[r, : len(s.block_ids)].tolist() == list(s.block_ids)
    assert (got.input_ids[3].item(), got.positions[3].item(), got.meta.slot_mapping[3].item()) == (
        0,
        0,
        99 * 4,
    )
    assert (got.meta.seq_lens[3].item(), got.meta.block_tables[3, 0].item()) == (1, 99)


class Recorder:
    """Wraps a DecodePath's graph runner: the shapes it ran."""

    def __init__(self, path: DecodePath) -> None:
        self.shapes: list[PaddedStep] = []
        self._run = path.graphs.run
        path.graphs.run = self  # type: ignore[method-assign]

    def __call__(self, shape: PaddedStep) -> torch.Tensor:
        self.shapes.append(shape)
        return self._run(shape)


def _greedy_both_ways(model: str, **config: Any) -> tuple[list[list[int]], list[list[int]], Recorder]:
    fast = LLM(model, **config)
    eager = LLM(model, **config)
    assert fast.engine.runner.decode is not None  # type: ignore[attr-defined]
    recorder = Recorder(fast.engine.runner.decode)  # type: ignore[attr-defined]
    eager.engine.runner.decode = None  # type: ignore[attr-defined]
    got, want = [], []
    for batch in (PROMPTS[:1], PROMPTS[:3], PROMPTS):  # 1, 3 and 7 sequences: padded to 1, 4 and 8
        got += [o.outputs[0].token_ids for o in fast.generate(batch, GREEDY)]
        want += [o.outputs[0].token_ids for o in eager.generate(batch, GREEDY)]
    return got, want, recorder


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_the_padded_static_buffer_path_gives_the_eager_paths_greedy_tokens_on_the_tiny_model(
    backend: str,
) -> None:
    got, want, recorder = _greedy_both_ways(
        "tiny", attention_backend=backend, cuda_graph_sizes=[1, 2, 4, 8], max_num_seqs=8,
        max_num_batched_tokens=16, block_size=4, num_kv_blocks=256,
    )  # fmt: skip
    assert got == want
    rows = {s.rows for s in recorder.shapes}
    assert rows <= {1, 2, 4, 8} and {4, 8} <= rows  # padded batches ran (3 -> 4, 7 -> 8 or 5 -> 8)


@pytest.mark.slow
def test_the_padded_static_buffer_path_gives_the_eager_paths_greedy_tokens_on_smollm2() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got, want, recorder = _greedy_both_ways(
            "smollm2", dtype="float32", cuda_graph_sizes=[1, 2, 4, 8], max_num_seqs=8,
            max_num_batched_tokens=32, block_size=16, num_kv_blocks=128, max_model_len=512,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert got == want
    assert {4, 8} <= {s.rows for s in recorder.shapes}


@pytest.fixture
def cuda_llms() -> Iterator[tuple[LLM, LLM]]:
    config = dict(dtype="float32", attention_backend="triton", max_num_seqs=8, num_kv_blocks=256)
    yield LLM("tiny", **config), LLM("tiny", enforce_eager=True, **config)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_give_the_eager_paths_greedy_tokens(cuda_llms: tuple[LLM, LLM]) -> None:
    graphs, eager = cuda_llms
    assert type(graphs.engine.runner.decode.graphs).__name__ == "CudaGraphs"  # type: ignore[attr-defined]
    got = [o.outputs[0].token_ids for o in graphs.generate(PROMPTS, GREEDY)]
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert got == want
