"""Rope scaling (linear, dynamic NTK, yarn) and sliding-window attention (Mistral, Qwen2) through
``kvfleet.engine.LLM`` on both attention backends, against transformers' greedy generate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.outputs import SampleResult
from kvfleet.engine.sched.plan import SchedulerPlan

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SHORT = [256, 72, 101, 108, 108, 111]  # 6 tokens: inside a window of 7 until the second output
CROSSING = [256] + list(range(100, 127))  # 28 tokens: decoding crosses max_position_embeddings=32
LONG = [256] + list(range(40, 80))  # 41 tokens: past 32 positions and far past the windows
PROMPTS = {
    "llama-rope-linear": [SHORT, LONG],
    "llama-rope-dynamic": [CROSSING, LONG],
    "llama-rope-yarn": [SHORT, LONG],
    "mistral-window": [SHORT, LONG],
    "qwen2-window": [SHORT, LONG],
}
BACKENDS = ["torch", "triton", "cpu"]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]


def reference(hf_greedy: Any, folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(folder, p, NEW_TOKENS, fresh=True) for p in prompts]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["llama-rope-linear", "llama-rope-dynamic", "llama-rope-yarn"])
def test_rope_scaled_llamas_decode_the_same_greedy_tokens_as_transformers(
    variant: str, backend: str, hf_checkpoints: dict[str, Path], hf_greedy: Any
) -> None:
    folder = hf_checkpoints[variant]
    llm = LLM(model=str(folder), attention_backend=backend, num_kv_blocks=64, block_size=4)
    prompts = PROMPTS[variant]
    assert generate(llm, prompts) == reference(hf_greedy, folder, prompts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["mistral-window", "qwen2-window"])
def test_sliding_window_models_decode_the_same_greedy_tokens_as_transformers(
    variant: str, backend: str, hf_checkpoints: dict[str, Path], hf_greedy: Any
) -> None:
    folder = hf_checkpoints[variant]
    llm = LLM(model=str(folder), attention_backend=backend, num_kv_blocks=64, block_size=4)
    assert llm.engine.max_model_len == 256  # the window no longer caps the context
    prompts = PROMPTS[variant]
    assert generate(llm, prompts) == reference(hf_greedy, folder, prompts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prompt_prefilled_in_chunks_longer_than_the_window_matches_transformers(
    backend: str, hf_checkpoints: dict[str, Path], hf_greedy: Any
) -> None:
    folder = hf_checkpoints["mistral-window"]
    llm = LLM(
        model=str(folder), attention_backend=backend, num_kv_blocks=64, block_size=4, max_num_batched_tokens=9
    )
    steps: list[tuple[int, int]] = []
    execute = llm.engine.runner.execute

    def spy(plan: SchedulerPlan) -> dict[int, SampleResult]:
        steps.extend((s.num_computed_before, s.num_new_tokens) for s in plan.scheduled)
        return execute(plan)

    llm.engine.runner.execute = spy  # type: ignore[method-assign]
    assert generate(llm, [LONG]) == reference(hf_greedy, folder, [LONG])
    prefill = [(0, 9), (9, 9), (18, 9), (27, 9), (36, 5)]  # every chunk longer than the window
    assert steps == prefill + [(41 + i, 1) for i in range(NEW_TOKENS - 1)]


def test_the_window_changes_what_the_mistral_checkpoint_generates(
    hf_checkpoints: dict[str, Path], hf_greedy: Any, tmp_path: Path
) -> None:
    """The scenarios above really exercise the window: without it transformers differs."""
    unwindowed = tmp_path / "mistral-no-window"
    shutil.copytree(hf_checkpoints["mistral-window"], unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    windowed = reference(hf_greedy, hf_checkpoints["mistral-window"], [LONG])
    assert windowed != reference(hf_greedy, unwindowed, [LONG])
    llm = LLM(model=str(unwindowed), num_kv_blocks=64, block_size=4)
    assert generate(llm, [LONG]) == reference(hf_greedy, unwindowed, [LONG])


def test_dynamic_rope_turns_prefix_caching_off_so_a_shared_prefix_still_matches_transformers(
    hf_checkpoints: dict[str, Path], hf_greedy: Any
) -> None:
    """A dynamic-rope block's keys depend on the length of the step that computed them (the
    41-token prefill rotated its first blocks with stretched frequencies): reusing them for a
    shorter prompt would differ from transformers, so no block is reused."""
    folder = hf_checkpoints["llama-rope-dynamic"]
    llm = LLM(model=str(folder), num_kv_blocks=64, block_size=4)
    short = LONG[:12] + [7, 8, 9]
    assert generate(llm, [LONG]) == reference(hf_greedy, folder, [LONG])
    (out,) = llm.generate([short], GREEDY)
    assert out.outputs[0].token_ids == reference(hf_greedy, folder, [short])[0]
    assert (out.num_cached_tokens, llm.engine.stats().prefix_cache_hits) == (0, 0)
