"""A bf16 model on the CPU (layers/linear/bf16.py): bf16 weights on the native kernel, float32 compute.

The one-call decode step (csrc/decode_layers.c, BF16_PANELS operands) runs the per-op path's own
bf16 kernel on the same path for the same rows, so its logits and K/V are the per-op step's bit
for bit, at 1 and 3 decode rows and with prompt chunks (6 rows; 13 rows: the AMX path where granted).
Against float32 the weights' bf16 rounding (2^-9 relative) moves the logits a little: greedy
continuations agree with float32's token for token on most prompts, and more than torch's
all-bf16 path (activations, norms and cache in bf16 too) does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels.native.bf16_gemm import AMX_MIN_ROWS, PATHS, load_bf16
from kvfleet.engine.kernels.native.decode_layers import BF16_PANELS
from kvfleet.engine.layers.linear import config as quant_config
from kvfleet.engine.runner.model_runner import ModelRunner

from ..kernels.test_bf16_cpu import PROMPTS
from .test_fused_decode import BLOCK, assert_one_call_is_the_per_op_step

native = load_bf16()
pytestmark = pytest.mark.skipif(native is None, reason="the native library does not build here")
TOKENS = 8


def bf16_runner(folder: Path) -> ModelRunner:
    config = EngineConfig(
        model=str(folder), num_kv_blocks=16, block_size=BLOCK, attention_backend="cpu", dtype="bfloat16"
    )
    return ModelRunner(config, folder)


@pytest.mark.parametrize(
    "step",
    [([2], None), ([0, 1, 2], None), ([0, 1, 2], [1, 4, 1]), ([0, 1, 2], [4, AMX_MIN_ROWS, 1])],
    ids=["1-row", "3-rows", "with-a-chunk", "amx-rows"],
)
def test_a_bf16_step_through_one_native_call_gives_the_per_op_logits_and_cache_bit_for_bit(
    step: tuple[list[int], list[int] | None], tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seqs, new = step
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tiny_dir, tmp_path / "tiny")
    runner = bf16_runner(tmp_path / "tiny")
    assert runner.dtype == torch.float32 and runner.quantization.method == "bf16"
    fused = runner.model.fused_decode()
    assert fused is not None and fused.native.geometry.max_rows is None
    assert {op.types for op in fused.native.operands} == {(BF16_PANELS,) * 4}
    assert native is not None and PATHS[fused.native.geometry.quant_path] == native.path
    assert_one_call_is_the_per_op_step(runner, seqs, new)


def greedy(folder: Path, dtype: str) -> list[list[int]]:
    llm = LLM(model=str(folder), dtype=dtype, device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return [list(r.outputs[0].token_ids) for r in llm.generate(PROMPTS, params)]


def agreeing(got: list[list[int]], want: list[list[int]]) -> tuple[int, int]:
    """(prompts whose whole continuation is float32's, tokens before each first divergence summed)."""
    whole, prefix = 0, 0
    for a, b in zip(got, want, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), TOKENS)
        whole += same == TOKENS
        prefix += same
    return whole, prefix


def test_bf16_weights_give_float32_s_greedy_tokens_on_most_prompts_and_beat_all_bf16(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked: at least 12 of 16 prompts continue exactly as float32 for 8 tokens, and the tokens
    agreeing before the first divergence are at least as many as torch's all-bf16 path's."""
    fp32 = greedy(tiny_dir, "float32")
    weights_only = greedy(tiny_dir, "bfloat16")
    monkeypatch.setattr(
        quant_config, "bf16_config", lambda device, dtype: None
    )  # today's all-bf16 torch path
    all_bf16 = greedy(tiny_dir, "bfloat16")
    whole, prefix = agreeing(weights_only, fp32)
    _, prefix_all = agreeing(all_bf16, fp32)
    assert whole >= 12, f"{whole} of {len(PROMPTS)} continuations equal float32's"
    assert prefix >= prefix_all, (prefix, prefix_all)
