"""An int8 model over two ranks (the quantized loader shards, each linear's method cutting its own
weights): its greedy tokens against one rank's. Column-parallel shards are the single rank's
columns bit for bit; row-parallel ones quantise each rank's slice of a token's activations with its
own scale (vLLM's per-token dynamic quantisation does the same on each rank), so the share of
prompts whose first greedy token agrees is asserted and printed, as the int8 tests compare int8
with float32 (tests/engine/layers/test_tp_over_methods.py tests the shards themselves)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.kernels.native.int8_gemm import load_int8

from .workers import first_token_agreement

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
PROMPTS = [
    torch.randint(3, 259, (3 + i % 8,), generator=torch.Generator().manual_seed(i)).tolist()
    for i in range(48)
]


@pytest.mark.skipif(load_int8() is None, reason="the native library does not build here")
@pytest.mark.parametrize("variant", ["llama-uneven-biased", "qwen2-tied"])
def test_an_int8_model_over_two_ranks_keeps_the_single_ranks_greedy_tokens(
    variant: str, tp_checkpoints: dict[str, Path]
) -> None:
    def make(tp: int) -> LLM:
        return LLM(
            str(tp_checkpoints[variant]), quantization="int8", tensor_parallel_size=tp, num_kv_blocks=64
        )

    share = first_token_agreement(make, PROMPTS, GREEDY)
    print(f"\n{variant} int8 tp=2 against tp=1: first greedy token agrees on {share:.0%}")
    assert share >= 0.8  # as int8 against float32 (tests/engine/model/test_hf_quant_loader.py)
