"""The whole engine (scheduler, KV cache manager, runner) through ``kvfleet.engine.LLM``, against
transformers' greedy generate: mixed batches, chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sched.plan import SchedulerPlan

from .conftest import PROMPTS

NEW_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
BACKENDS = ["torch", "triton", "cpu"]


def prompts_for(backend: str) -> list[list[int]]:
    """Triton runs interpreted on the CPU: a short and a long prompt are enough to cover it."""
    return PROMPTS if backend != "triton" else [PROMPTS[0], PROMPTS[2]]


@pytest.fixture
def llm_of(hf_checkpoints: dict[str, Path]) -> Callable[..., tuple[Path, LLM]]:
    """A variant's checkpoint folder and an ``LLM`` over it on ``backend``, with the engine ``options``."""

    def make(variant: str, backend: str, **options: int) -> tuple[Path, LLM]:
        folder = hf_checkpoints[variant]
        return folder, LLM(model=str(folder), attention_backend=backend, **options)

    return make


def tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]


def record_plans(llm: LLM) -> list[SchedulerPlan]:
    """Wrap the engine's runner so the test sees every plan it executed."""
    plans: list[SchedulerPlan] = []
    runner = llm.engine.runner
    execute = runner.execute

    def spy(plan: SchedulerPlan) -> dict[int, SampleResult]:
        plans.append(plan)
        return execute(plan)

    runner.execute = spy  # type: ignore[method-assign]
    return plans


@pytest.mark.parametrize(
    ("variant", "backend"),
    [
        ("llama-gqa-llama3-sharded", "torch"),
        ("qwen2-tied", "torch"),
        ("llama-gqa-llama3-sharded", "triton"),
        ("llama-gqa-llama3-sharded", "cpu"),
        ("qwen2-tied", "cpu"),
    ],
)
def test_a_batch_of_mixed_prompt_lengths_through_llm_generate_matches_transformers(
    variant: str, backend: str, llm_of: Callable[..., tuple[Path, LLM]], hf_greedy: Any
) -> None:
    folder, llm = llm_of(variant, backend, num_kv_blocks=64)
    prompts = prompts_for(backend)
    assert tokens(llm, prompts) == [hf_greedy(folder, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_under_a_small_token_budget_matches_transformers(
    backend: str, llm_of: Callable[..., tuple[Path, LLM]], hf_greedy: Any
) -> None:
    folder, llm = llm_of("qwen2-tied", backend, num_kv_blocks=64, max_num_batched_tokens=8)
    plans = record_plans(llm)
    prompts = prompts_for(backend)
    assert tokens(llm, prompts) == [hf_greedy(folder, p, NEW_TOKENS) for p in prompts]
    assert max(p.num_batched_tokens for p in plans) == 8
    chunks = [s for p in plans for s in p.scheduled if not s.sample]
    assert chunks, "the 30-token prompt cannot fit one 8-token step: some step computes a chunk only"


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_under_a_tiny_kv_budget_recomputes_to_the_same_tokens(
    backend: str, llm_of: Callable[..., tuple[Path, LLM]], hf_greedy: Any
) -> None:
    folder, llm = llm_of("llama-gqa-llama3-sharded", backend, num_kv_blocks=7, block_size=4)
    # Three 8-token prompts fill 6 of 7 four-token blocks; the first decode steps need a third
    # block each, so the latest sequence is preempted and recomputed later.
    prompts = [[256] + [10 * i + j for j in range(7)] for i in range(3)]
    assert tokens(llm, prompts) == [hf_greedy(folder, p, NEW_TOKENS) for p in prompts]
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_request_sharing_a_prefix_hits_the_cache_and_decodes_the_same_tokens(
    backend: str, llm_of: Callable[..., tuple[Path, LLM]], hf_greedy: Any
) -> None:
    folder, llm = llm_of("qwen2-tied", backend, num_kv_blocks=64, block_size=4)
    first = PROMPTS[2]
    second = first[:12] + [7, 8, 9, 10, 11]  # the first 3 blocks are the first prompt's
    assert tokens(llm, [first]) == [hf_greedy(folder, first, NEW_TOKENS)]
    hits_before = llm.engine.stats().prefix_cache_hits
    (out,) = llm.generate([second], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy(folder, second, NEW_TOKENS)
    assert out.num_cached_tokens == 12
    assert llm.engine.stats().prefix_cache_hits - hits_before == 12


def test_the_tiny_model_generates_text_through_llm_as_a_user_calls_it(tiny_dir: Path, hf_greedy: Any) -> None:
    llm = LLM(model=str(tiny_dir), num_kv_blocks=32)
    (out,) = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out.prompt_token_ids == [256, 72, 101, 108, 108, 111]
    assert out.outputs[0].token_ids == hf_greedy(tiny_dir, out.prompt_token_ids, 8)
    assert out.outputs[0].finish_reason == "length"
    expected = b"".join(bytes([t]) for t in out.outputs[0].token_ids if t < 256).decode("utf-8", "replace")
    assert out.outputs[0].text == expected
