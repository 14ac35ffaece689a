"""A bf16 model over two ranks on the CPU (``layers/linear/bf16.py``: each rank's bf16 panels cut from
the whole weight, float32 compute): its greedy tokens against one rank's. Column-parallel shards
are the single rank's columns bit for bit; a row-parallel matmul sums each rank's slice of k in
float32 and the ranks' sums are added, so only the order of float32 additions differs: the first
greedy token agrees on nearly every prompt (asserted: 90%, printed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.kernels.native.bf16_gemm import load_bf16

from .workers import first_token_agreement

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
PROMPTS = [
    torch.randint(3, 259, (3 + i % 8,), generator=torch.Generator().manual_seed(i)).tolist()
    for i in range(48)
]


@pytest.mark.skipif(load_bf16() is None, reason="the native library does not build here")
def test_a_bf16_model_over_two_ranks_keeps_the_single_ranks_greedy_tokens(
    tp_checkpoints: dict[str, Path],
) -> None:
    def make(tp: int) -> LLM:
        return LLM(
            str(tp_checkpoints["llama-uneven-biased"]), dtype="bfloat16", device="cpu",
            tensor_parallel_size=tp, num_kv_blocks=64,
        )  # fmt: skip

    def bf16_weights(llm: LLM) -> None:
        assert llm.engine.runner.quantization.method == "bf16"

    share = first_token_agreement(make, PROMPTS, GREEDY, bf16_weights)
    print(f"\nbf16 tp=2 against tp=1: first greedy token agrees on {share:.0%}")
    assert share >= 0.9
