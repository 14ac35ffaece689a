"""Gemma 3's hybrid KV cache through the whole engine (engine/kv/groups.py): its sliding layer and its
global layer are two KV cache groups with their own block tables in one pool; the sliding group's
blocks are freed as decoding slides past its window of 6, a long shared prompt (16 tokens, longer
than the window) hits the cache exactly, and the tokens equal a run with caching off and transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfleet.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SHARED = [256] + list(range(60, 75))  # 16 tokens: 4 whole blocks of 4
PROMPTS = [SHARED + [3, 9, 27], SHARED + [5, 25], SHARED + [7, 49, 90, 91]]
ENGINE: dict[str, Any] = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4)


def test_the_sliding_group_frees_blocks_and_a_long_shared_prompt_hits_exactly(
    hf_checkpoints: dict[str, Path], hf_greedy: Any
) -> None:
    folder = hf_checkpoints["gemma3-window"]
    llm = LLM(model=str(folder), attention_backend="torch", **ENGINE)
    runner = llm.engine.runner
    assert runner.kv_layout.windows == (None, 6) and llm.engine.kv.group_windows == (None, 6)
    assert runner.kv_caches[0] is runner.kv_caches[1]  # one page: the i-th layer of each group
    first = llm.generate(PROMPTS[:1], GREEDY)
    assert llm.engine.kv.window_freed_blocks > 0, "a 24-token decode past a 6-key window frees blocks"
    rest = llm.generate(PROMPTS[1:], GREEDY)
    assert [o.num_cached_tokens for o in rest] == [16, 16]
    ours = [o.outputs[0].token_ids for o in first + rest]
    off = LLM(model=str(folder), attention_backend="torch", enable_prefix_caching=False, **ENGINE)
    assert ours == [o.outputs[0].token_ids for o in off.generate(PROMPTS, GREEDY)]
    assert ours == [hf_greedy(folder, p, 24) for p in PROMPTS]
    assert llm.engine.kv.num_free_blocks == 64  # every block back once all finished


def test_a_model_of_one_attention_type_keeps_one_table_and_one_tensor_per_layer(
    hf_checkpoints: dict[str, Path],
) -> None:
    llm = LLM(model=str(hf_checkpoints["mistral-window"]), attention_backend="torch", **ENGINE)
    runner = llm.engine.runner
    assert not runner.kv_layout.hybrid and llm.engine.kv.group_windows == (7,)
    assert len({id(t) for t in runner.kv_caches}) == len(runner.kv_caches)
