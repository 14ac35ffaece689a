"""tp=2 gives tp=1's greedy tokens through the engine: GQA, MQA (replicated KV head), tied embeddings,
biases and an uneven split, on a batch with chunked prefill, prefix-cache hits and preemption, and
with LoRA adapters beside base requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.outputs import RequestOutput

from ..lora.conftest import ADAPTERS, make_adapter
from .compare import assert_same_greedy
from .workers import assert_workers_ran

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
SYSTEM = [256] + list(range(60, 80))  # a shared 21-token prefix: later prompts hit the prefix cache
PROMPTS = [
    SYSTEM + [72, 101, 108],
    [256, 1, 2, 3],
    SYSTEM + [200, 201, 202, 203, 204, 205],
    [256] + list(range(100, 130)),
    SYSTEM + [9],
    [256, 50, 51, 52, 53, 54, 55, 56, 57, 58],
]
# Chunked prefill (16-token budget), 4-token blocks and too few of them for all at once (preemption).
ENGINE: dict[str, Any] = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=6)
# Qwen3's and Gemma 3's sliding and full layers are two KV cache groups (engine/kv/groups.py): a block is
# a page of one of their two layers, so 28 of them are the KV memory 14 two-layer blocks were.
HYBRID = {"qwen3-window", "gemma3-window"}


def run(
    folder: Path, tp: int, lora: list[str | None] | None = None, **extra: Any
) -> tuple[list[RequestOutput], Any]:
    llm = LLM(str(folder), tensor_parallel_size=tp, **(ENGINE | extra))
    try:
        first = llm.generate(PROMPTS[:1], GREEDY)  # warms the prefix cache with SYSTEM
        rest = llm.generate(PROMPTS[1:], GREEDY, lora=lora)
        assert_workers_ran(llm, tp)
        return first + rest, llm.engine.stats()
    finally:
        llm.close()


@pytest.mark.parametrize(
    "variant",
    [
        "llama-gqa-llama3-sharded",
        "mistral-mqa",
        "qwen2-tied",
        "llama-uneven-biased",
        "qwen3-window",
        "gemma3-window",
    ],
)
def test_tp2_greedy_tokens_equal_tp1(tp_checkpoints: dict[str, Path], variant: str) -> None:
    pages = {"num_kv_blocks": 28} if variant in HYBRID else {}
    ref, _ = run(tp_checkpoints[variant], 1, **pages)
    got, stats = run(tp_checkpoints[variant], 2, **pages)
    assert_same_greedy(ref, got, variant)
    assert stats.num_preemptions > 0, "the batch was meant to preempt"
    assert stats.prefix_cache_hits > 0, "the shared prefix was meant to hit"


def test_tp2_lora_adapters_beside_base_requests_equal_tp1(
    tp_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Adapters on every projection (row-parallel A sliced, column-parallel B sliced) over the uneven
    split, two resident at once beside base rows, one loaded at run time on every rank."""
    base = tp_checkpoints["llama-uneven-biased"]
    folders = {
        name: make_adapter(base, tmp_path / name, *ADAPTERS[name], seed=i)
        for i, name in enumerate(("all-r2", "mlp-r8", "attn-r4"))
    }
    lora: list[str | None] = ["all-r2", None, "mlp-r8", "all-r2", "attn-r4"]
    outs = []
    for tp in (1, 2):
        llm = LLM(str(base), tensor_parallel_size=tp, **ENGINE, max_loras=2, max_lora_rank=8,
                  lora_modules={k: str(v) for k, v in folders.items() if k != "attn-r4"})  # fmt: skip
        try:
            llm.load_lora("attn-r4", str(folders["attn-r4"]))  # at run time: reaches the worker too
            outs.append(llm.generate(PROMPTS[1:], GREEDY, lora=lora))
            assert llm.engine.stats().lora is not None
            assert_workers_ran(llm, tp)
        finally:
            llm.close()
    assert_same_greedy(outs[0], outs[1], "lora")
    base_only = run(base, 1)[0][1:]
    assert [o.outputs[0].token_ids for o in outs[0]] != [o.outputs[0].token_ids for o in base_only]
