"""SmolLM2-135M at tp=2 (uneven: KV heads {0,1} and {2}) gives tp=1's greedy tokens on chat prompts,
with chunked prefill; a near-tie divergence is reported, any other fails."""

from __future__ import annotations

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.tokenizer.hf import HFTokenizer

from .compare import assert_same_greedy
from .workers import assert_workers_ran

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
CHATS = ["Name a colour.", "Count to five.", "What is the capital of France?"]


def test_smollm2_tp2_greedy_tokens_equal_tp1() -> None:
    tokenizer = HFTokenizer(resolve_model("smollm2"))
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False
        )
        for c in CHATS
    ]
    outs = []
    for tp in (1, 2):
        llm = LLM(
            "smollm2", tensor_parallel_size=tp, max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=64
        )
        try:
            outs.append(llm.generate(prompts, GREEDY))
            assert_workers_ran(llm, tp)
        finally:
            llm.close()
    assert_same_greedy(outs[0], outs[1], "smollm2")
