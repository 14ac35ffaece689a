"""Qwen3-MoE and Mixtral served with ``--quantization int8``: every expert's matmuls int8 on the
grouped path (``layers/moe``'s ``KernelExperts``), the router in floats; the float model's first
token wherever the float model's top two are ``MARGIN`` apart (int8 moves a random tiny model's
logprobs by about 0.1 to 0.4, and a routing flip further), and tp=2's as tp=1's alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.layers.moe import KernelExperts
from kvfleet.engine.loader.resident import resident_weight_bytes
from kvfleet.engine.model.moe import SparseMoeBlock
from kvfleet.engine.outputs import RequestOutput

from ..parallel.workers import assert_workers_ran
from .moe_checkpoints import ENGINE, PROMPTS, make_moe_checkpoint

MARGIN = 0.2
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
def test_int8_experts_serve_the_float_models_first_tokens_and_tp2_equals_tp1(
    variant: str, tmp_path: Path
) -> None:
    folder = str(make_moe_checkpoint(variant, tmp_path / variant))
    float_llm = LLM(folder, **ENGINE)
    floats = float_llm.generate(PROMPTS, PARAMS)
    float_bytes = resident_weight_bytes(float_llm.engine.runner.model)
    outs = []
    for tp in (1, 2):
        llm = LLM(folder, quantization="int8", tensor_parallel_size=tp, **ENGINE)
        try:
            outs.append(llm.generate(PROMPTS, PARAMS))
            assert_workers_ran(llm, tp)
            if tp == 1:
                model = llm.engine.runner.model
                blocks = [
                    b
                    for b in (layer.feed_forward() for layer in model.model.layers)
                    if isinstance(b, SparseMoeBlock)
                ]
                assert blocks and all(isinstance(b.experts_now(), KernelExperts) for b in blocks)
                assert resident_weight_bytes(model) < 0.4 * float_bytes
        finally:
            llm.close()
    assert_clear_first_tokens_agree(floats, outs[0], f"{variant} int8 vs float")
    # a row-parallel int8 matmul quantises each rank's slice of the activations with its own scale
    assert_clear_first_tokens_agree(outs[0], outs[1], f"{variant} int8 tp=2 vs tp=1")


def assert_clear_first_tokens_agree(ref: list[RequestOutput], got: list[RequestOutput], label: str) -> None:
    decided = [i for i, o in enumerate(ref) if _gap(o) > MARGIN]
    assert len(decided) >= 8, f"{label}: too few prompts with a clear first token to compare"
    for i in decided:
        assert got[i].outputs[0].token_ids[0] == ref[i].outputs[0].token_ids[0], f"{label}: prompt {i}"


def _gap(out: RequestOutput) -> float:
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None
    top = logprobs[0].top
    return top[0][1] - top[1][1]
