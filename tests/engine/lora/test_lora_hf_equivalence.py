"""Greedy tokens of adapters and the base model in one mixed batch against transformers + peft.

Three adapters of different ranks and targets (q/v at r=4; gate/up/down at r=8 with rsLoRA;
all seven projections at r=2) share steps with base-model requests; each request's tokens
must be PeftModel's greedy tokens for its adapter (transformers' for the base).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvfleet.engine import LLM, SamplingParams

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3], [256, *range(40, 69)], [256, 200, 201, 202, 203]]
NEW_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
Greedy = Callable[[Path, Path | None, list[int], int], list[int]]


def mixed(adapters: dict[str, Path]) -> list[tuple[list[int], str | None]]:
    """Every prompt under the base model and under each adapter, interleaved."""
    names: list[str | None] = [None, *adapters]
    return [(p, names[(i + j) % len(names)]) for i, p in enumerate(PROMPTS) for j in range(len(names))]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_three_adapters_and_the_base_model_in_one_batch_match_peft(
    backend: str, lora_base: Path, adapters: dict[str, Path], peft_greedy: Greedy
) -> None:
    modules = {name: str(path) for name, path in adapters.items()}
    llm = LLM(
        model=str(lora_base), attention_backend=backend, num_kv_blocks=128, lora_modules=modules, max_loras=3
    )
    requests = mixed(adapters)
    outs = llm.generate([p for p, _ in requests], GREEDY, lora=[a for _, a in requests])
    got = [o.outputs[0].token_ids for o in outs]
    want = [peft_greedy(lora_base, None if a is None else adapters[a], p, NEW_TOKENS) for p, a in requests]
    assert got == want
    base_tokens = {
        tuple(w) for (p, a), w in zip(requests, want, strict=True) if a is None and p == PROMPTS[0]
    }
    adapter_tokens = {tuple(w) for (p, a), w in zip(requests, want, strict=True) if a and p == PROMPTS[0]}
    assert adapter_tokens - base_tokens, "the adapters change the tokens: the test can tell them apart"
