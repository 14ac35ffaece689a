"""The step dispatcher (engine/runner/step_dispatch.py) on plans alone: a table of plans and runner
capabilities, each with the route it takes and the words of its reason; no model, no tensor.
One test at the end runs the tiny model to hold the runner to the routes it logs."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvfleet.engine.model.fused_layers import NativeStep
from kvfleet.engine.runner.step_dispatch import PlanShape, RunnerCaps, StepDispatcher, route
from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputSpec
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
BLOCK = 16

# A GPU runner: CUDA graphs captured for 1, 2, 4 and 8 rows of up to 8 blocks, no native call.
GPU = RunnerCaps((1, 2, 4, 8), 8, graphs=True, no_native="no native call on cuda")
# A CPU runner on the cpu backend with natively packed weights: every batch size a plain call.
CPU = RunnerCaps(tuple(range(1, 9)), 8, native=NativeStep(max_rows=None, prompt_chunks=True))
# Unpacked weights: the few-row kernel, so at most 16 rows; padded to cuda_graph_sizes.
FEW_ROWS = RunnerCaps((1, 2, 4, 8), 8, native=NativeStep(max_rows=16, prompt_chunks=True))
# A geometry the native prefill kernel does not take: prompt chunks run on SDPA.
SDPA_CHUNKS = RunnerCaps(tuple(range(1, 9)), 8, native=NativeStep(max_rows=None, prompt_chunks=False))
# Tensor parallelism: no static buffers, no native call.
TP = RunnerCaps(no_native="tensor parallelism: the native call holds no all-reduce")


def seq(prompt: int, outputs: int = 0, lora: str | None = None, params: SamplingParams = GREEDY) -> Sequence:
    return Sequence(
        request_id="r", prompt_token_ids=list(range(3, 3 + prompt)), params=params,
        output_token_ids=[7] * outputs, lora_name=lora,
    )  # fmt: skip


def decoding(s: Sequence) -> ScheduledSeq:
    """``s``'s next token: its last known one, sampled."""
    start = s.num_tokens - 1
    return ScheduledSeq(s, start, 1, tuple(range(start // BLOCK + 1)))


def chunk(s: Sequence, start: int, new: int) -> ScheduledSeq:
    return ScheduledSeq(s, start, new, tuple(range((start + new - 1) // BLOCK + 1)))


def plan(*scheduled: ScheduledSeq) -> SchedulerPlan:
    return SchedulerPlan(scheduled=scheduled)


def decodes(n: int, prompt: int = 20, **kw: Any) -> SchedulerPlan:
    return plan(*(decoding(seq(prompt, 2, **kw)) for _ in range(n)))


STRUCTURED = SamplingParams(temperature=0.7, top_p=0.9, structured=StructuredOutputSpec("regex", "[a-z]+"))

TABLE = [
    (decodes(3), GPU, "graph", "replays the graph captured for 4 rows", 4),
    (decodes(8), GPU, "graph", "replays the graph captured for 8 rows", 8),
    (decodes(9), GPU, "per_op", "no captured graph holds it, and no native call on cuda", 9),
    (decodes(2, prompt=200), GPU, "per_op", "no captured graph holds it", 2),
    (decodes(2, lora="a"), GPU, "per_op", "no captured graph holds it", 2),
    (plan(chunk(seq(40), 0, 40)), GPU, "per_op", "with prompt chunks", 40),
    (decodes(3), CPU, "native", "decode step of 3 rows: every layer in one native call", 3),
    (decodes(3), FEW_ROWS, "native", "decode step of 3 rows (padded to 4)", 4),
    (plan(chunk(seq(40), 0, 40)), CPU, "native", "40 rows, with prompt chunks: every layer", 40),
    (plan(chunk(seq(40), 0, 40)), FEW_ROWS, "per_op", "40 rows, past the 16", 40),
    (plan(chunk(seq(12), 0, 12), decoding(seq(9, 1))), FEW_ROWS, "native", "13 rows, with prompt", 13),
    (plan(chunk(seq(40), 0, 40)), SDPA_CHUNKS, "per_op", "prompt chunks of this geometry run on SDPA", 40),
    (decodes(3), SDPA_CHUNKS, "native", "decode step of 3 rows", 3),
    (decodes(3, lora="a"), CPU, "per_op", "a LoRA adapter applies per row", 3),
    (plan(chunk(seq(40), 39, 1)), CPU, "native", "decode step of 1 rows", 1),
    (plan(chunk(seq(40), 20, 1)), CPU, "native", "step of 1 sequences, 1 rows, of single tokens", 1),
    (decodes(3), TP, "per_op", "tensor parallelism: the native call holds no all-reduce", 3),
    (decodes(3, params=STRUCTURED), CPU, "native", "decode step of 3 rows", 3),
    (decodes(3, params=STRUCTURED), GPU, "graph", "replays the graph captured for 4 rows", 4),
]
IDS = [
    "a decode step of 3 rows on captured graphs replays the graph of 4",
    "a decode step of as many rows as the largest graph replays it",
    "a decode step past the largest graph runs per op on a GPU",
    "a decode step wider than the buffers' block tables runs per op",
    "a decode step under a LoRA adapter never replays a graph",
    "a prompt chunk on a GPU runs per op: no graph holds its shape",
    "a decode step on packed CPU weights runs in one native call, unpadded",
    "a decode step padded to a size stays in one native call within the few-row limit",
    "a prompt chunk runs in one native call where its geometry prefills natively",
    "a prompt chunk past the few-row kernel's rows runs per op",
    "a chunk beside a decode within the few-row limit runs in one native call",
    "a prompt chunk whose geometry runs on SDPA runs per op",
    "decodes still take the native call where only prompt chunks would run on SDPA",
    "a LoRA step runs per op: the adapter context is per row",
    "a one-token chunk that ends the prompt is a decode step",
    "a one-token chunk in the middle of a prompt samples nothing and is no decode step",
    "tensor parallelism runs every step per op and says why",
    "sampling parameters and structured outputs do not move a step off the native call",
    "sampling parameters and structured outputs do not move a step off its graph",
]


@pytest.mark.parametrize(("the_plan", "caps", "path", "words", "rows"), TABLE, ids=IDS)
def test_a_plan_takes_the_route_its_shape_and_the_runners_capabilities_allow(
    the_plan: SchedulerPlan, caps: RunnerCaps, path: str, words: str, rows: int
) -> None:
    got = route(PlanShape.of(the_plan), caps)
    assert (got.path, got.rows) == (path, rows)
    assert words in got.reason, got.reason


def test_a_step_is_padded_exactly_when_it_runs_over_the_static_buffers() -> None:
    assert route(PlanShape.of(decodes(3)), FEW_ROWS).padded
    assert route(PlanShape.of(decodes(3)), GPU).padded
    assert not route(PlanShape.of(decodes(3)), TP).padded
    assert not route(PlanShape.of(decodes(9)), GPU).padded
    assert not route(PlanShape.of(plan(chunk(seq(40), 0, 40))), CPU).padded


def test_the_plan_shape_reads_counts_and_flags_only() -> None:
    shape = PlanShape.of(plan(chunk(seq(40), 0, 40), decoding(seq(9, 1, lora="a"))))
    assert shape == PlanShape(seqs=2, tokens=41, decode=False, prompt_chunks=True, lora=True, widest=3)


def test_the_dispatcher_says_the_route_and_why_in_a_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvfleet.engine.runner.step_dispatch"):
        got = StepDispatcher(GPU).pick(decodes(3))
    assert caplog.messages == [f"step route graph: {got.reason}"]


def test_the_runner_takes_each_route_it_logs_and_the_native_call_never_refuses_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvfleet.engine import LLM
    from kvfleet.engine.model.fused_layers import FusedLayers as FusedLayers

    taken: list[bool] = []
    run = FusedLayers.run

    def spy(self: FusedLayers, *args: Any) -> Any:
        out = run(self, *args)
        taken.append(out is not None)
        return out

    llm = LLM("tiny", attention_backend="cpu", num_kv_blocks=64, weight_packing="native")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with (
        pytest.MonkeyPatch.context() as patch,
        caplog.at_level(logging.DEBUG, "kvfleet.engine.runner.step_dispatch"),
    ):
        patch.setattr(FusedLayers, "run", spy)
        llm.generate(["hello there", "a longer prompt about kubernetes"], params)
    routes = [m.split(":")[0] for m in caplog.messages if m.startswith("step route")]
    assert routes and set(routes) == {"step route native"}
    assert taken == [True] * len(routes)  # called once per native step, and never refused
    llm.engine.runner.model.use_fused_decode = False  # type: ignore[attr-defined]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, "kvfleet.engine.runner.step_dispatch"):
        llm.generate(["hello"], params)
    assert {m for m in caplog.messages if m.startswith("step route")} >= {
        "step route per_op: decode step of 1 rows: the native call is turned off"
    }
