"""Each registered family beyond Llama (engine/model/families/) through the whole engine against
transformers: 16 prompts x 32 greedy tokens with chunked prefill, prefix-cache hits and preemption
forced, and the prefill logits within a stated tolerance. The checkpoints are tiny random ones made
from transformers' own config classes (conftest.py), with windows shorter than the prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.model.batch import flatten_plan

from .test_engine_hf_equivalence import record_plans
from .test_runner_hf_equivalence import HandScheduler, make_runner, new_seq

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SYSTEM = [256] + list(range(60, 75))  # 16 tokens (4 whole blocks) shared by every other prompt
PROMPTS = [
    (SYSTEM if i % 2 == 0 else [256]) + [(37 * i + 11 * j) % 256 for j in range(3 + (i * 5) % 23)]
    for i in range(16)
]
# Chunked prefill (an 8-token budget), 4-token blocks and too few of them for all 16 at once. Qwen3's
# and Gemma 3's sliding and full layers are two KV cache groups (engine/kv/groups.py): a block is a
# page of one layer's KV (half of what a two-layer block was) and a sequence holds a table in each
# group, so 80 pages are less KV memory than 48 blocks were, and still force preemption.
ENGINE: dict[str, Any] = dict(block_size=4, num_kv_blocks=80, max_num_batched_tokens=8, max_num_seqs=8)
FAMILIES = ["qwen3-window", "gemma3-window"]
LOGIT_TOLERANCE = 1e-4  # float32, absolute and relative


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("variant", FAMILIES)
def test_sixteen_prompts_decode_transformers_greedy_tokens_through_chunks_prefix_hits_and_preemption(
    variant: str, backend: str, hf_checkpoints: dict[str, Path], hf_greedy: Any
) -> None:
    folder = hf_checkpoints[variant]
    llm = LLM(model=str(folder), attention_backend=backend, **ENGINE)
    plans = record_plans(llm)
    first = llm.generate(PROMPTS[:1], GREEDY)  # warms the prefix cache with SYSTEM
    rest = llm.generate(PROMPTS[1:], GREEDY)
    ours = [out.outputs[0].token_ids for out in first + rest]
    assert ours == [hf_greedy(folder, p, NEW_TOKENS) for p in PROMPTS]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the batch was meant to preempt"
    assert stats.prefix_cache_hits >= 16 * 7, "each later SYSTEM prompt was meant to hit its 4 blocks"
    chunks = [s for p in plans for s in p.scheduled if not s.sample]
    assert chunks, "prompts longer than the 8-token budget were meant to be prefilled in chunks"


@pytest.mark.parametrize("variant", FAMILIES)
def test_prefill_logits_are_within_the_stated_tolerance_of_transformers(
    variant: str, hf_checkpoints: dict[str, Path], hf_model: Any
) -> None:
    folder = hf_checkpoints[variant]
    runner = make_runner(folder, num_blocks=128)  # pages of one layer: as 64 blocks of both were
    sched = HandScheduler.for_runner(runner)  # a table in each KV cache group
    prompts = PROMPTS[:6]

    batch = flatten_plan(sched.decode_all([new_seq(p) for p in prompts]), runner.block_size, runner.device)
    with torch.inference_mode():
        ours = runner.model(
            batch.input_ids, batch.positions, runner.kv_caches, batch.meta, runner.backend, batch.sample_rows
        )
    model = hf_model(folder)
    with torch.no_grad():
        theirs = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(ours, theirs, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        ("qwen3-window", "Qwen3ForCausalLM's q/k norms are not part of the native decode call"),
        ("gemma3-window", "Gemma 3's layers (sandwich norms, GeGLU, two rotary bases) are not part of"),
    ],
)
def test_the_step_dispatcher_says_why_the_native_call_does_not_take_a_familys_steps(
    variant: str, why: str, hf_checkpoints: dict[str, Path]
) -> None:
    runner, sched = make_runner(hf_checkpoints[variant], backend="cpu"), HandScheduler()
    route = runner.route(sched.decode_all([new_seq(PROMPTS[1])]))
    assert route.path == "per_op"
    assert why in route.reason


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_blocks_out_of_every_layers_window_are_freed_and_a_long_shared_prefix_still_hits_exactly(
    backend: str, hf_checkpoints: dict[str, Path], hf_greedy: Any
) -> None:
    """Mistral's window of 7 keys on every layer: the engine frees each sequence's blocks as they
    fall out of it, and a prompt sharing a 16-token prefix (longer than the window) hits the cache
    and decodes transformers' tokens."""
    folder = hf_checkpoints["mistral-window"]
    llm = LLM(model=str(folder), attention_backend=backend, **ENGINE)
    prompts = PROMPTS[:4] if backend != "triton" else [PROMPTS[0], PROMPTS[2]]  # triton runs interpreted
    first = llm.generate(prompts[:1], GREEDY)
    assert llm.engine.kv.window_freed_blocks > 0, "a 32-token decode past a 7-key window frees blocks"
    rest = llm.generate(prompts[1:], GREEDY)
    assert [o.outputs[0].token_ids for o in first + rest] == [
        hf_greedy(folder, p, NEW_TOKENS) for p in prompts
    ]
    assert rest[1 if backend != "triton" else 0].num_cached_tokens == 16
