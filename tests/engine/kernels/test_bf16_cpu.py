"""``--dtype bfloat16`` on the CPU (issue #34, #47): oneDNN's packed bf16 linear, the prepack choice by CPU
path, the warning where the CPU has no bf16 path, the bf16 method (bf16 weights on the native kernel,
float32 activations: ``layers/linear/bf16.py``), and next-token agreement with float32."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels import packing
from kvfleet.engine.kernels.native import cpu_features
from kvfleet.engine.kernels.packing.onednn import OnednnPackedWeight, bf16_available
from kvfleet.engine.runner.model_runner import ModelRunner
from kvfleet.engine.testing.tiny import ensure_tiny_model

HAS_BF16_PATH = cpu_features.probe_cpu_paths().bf16.path != "none"
needs_bf16 = pytest.mark.skipif(
    not (HAS_BF16_PATH and bf16_available()), reason="this CPU has no bf16 path for oneDNN"
)
PROMPTS = [
    "hello world",
    "the",
    "kvfleet serves models on kubernetes",
    "The capital of France is",
    "1 2 3 4 5",
    "abcdefghij",
    "Once upon a time",
    "def main():",
    "zzzz",
    "What is the meaning of life?",
    "paged attention over blocks",
    "SELECT * FROM",
    "<html><body>",
    "quick brown fox",
    "[1, 2, 3]",
    "bf16 vs fp32",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("kvfleet-cache"))


@needs_bf16
def test_a_bf16_weight_packed_for_onednn_gives_f_linear_s_result_in_bf16() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(33, 64, dtype=torch.bfloat16)
    packed = OnednnPackedWeight.pack(weight)
    assert packed is not None and packed.dtype == torch.bfloat16
    with torch.inference_mode():
        assert packed.takes(x) and not packed.takes(x.float())
        got, want = packed(x, None), F.linear(x, weight)
    assert got.dtype == torch.bfloat16
    # Both accumulate in float32 and round once to bf16 (8 bits of mantissa): one bf16 ulp apart at most
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-2)


def test_a_float32_only_packer_refuses_bf16_weights() -> None:
    assert packing.PACKERS["mkl"].pack(torch.ones(8, 8, dtype=torch.bfloat16)) is None
    assert packing.resolve("native", torch.ones(8, 8, dtype=torch.bfloat16)) is None


def test_only_a_cpu_with_a_bf16_path_prepacks_a_bf16_model(monkeypatch: pytest.MonkeyPatch) -> None:
    avx2 = cpu_features.choose_cpu_paths(frozenset({"avx2"}), None)
    monkeypatch.setattr(packing, "probe_cpu_paths", lambda: avx2)
    assert not packing.packs_model_dtype(torch.bfloat16)
    assert packing.packs_model_dtype(torch.float32)
    assert not packing.packs_model_dtype(torch.float16)
    zen4 = cpu_features.choose_cpu_paths(frozenset({"avx2", "avx512f", "avx512_bf16"}), None)
    monkeypatch.setattr(packing, "probe_cpu_paths", lambda: zen4)
    assert packing.packs_model_dtype(torch.bfloat16)


def test_bf16_on_a_cpu_without_a_bf16_path_is_kept_unpacked_and_warned_about(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import kvfleet.engine.runner.model_runner as runner_module

    avx2 = cpu_features.choose_cpu_paths(frozenset({"avx2"}), None)
    monkeypatch.setattr(packing, "probe_cpu_paths", lambda: avx2)
    monkeypatch.setattr(runner_module, "probe_cpu_paths", lambda: avx2)
    config = EngineConfig(model=str(tiny), dtype="bfloat16", device="cpu", num_kv_blocks=8)
    with caplog.at_level(logging.WARNING, logger="kvfleet.engine.runner.model_runner"):
        runner = ModelRunner(config, tiny)
    # the native bf16 kernel's portable path keeps the bf16 weights; the activations stay float32
    assert runner.quantization.method == "bf16" and runner.dtype == torch.float32
    assert runner.weight_packing is None
    assert "dtype bfloat16 kept as asked" in caplog.text and "use --dtype float32" in caplog.text


def test_a_bf16_model_on_the_cpu_keeps_bf16_weights_on_the_native_kernel_and_float32_activations(
    tiny: Path,
) -> None:
    config = EngineConfig(model=str(tiny), dtype="bfloat16", device="cpu", num_kv_blocks=8)
    runner = ModelRunner(config, tiny)
    assert runner.quantization.method == "bf16" and runner.weight_packing is None
    assert runner.dtype == torch.float32 and runner.kv_caches[0].dtype == torch.float32
    layer = runner.model.model.layers[0]
    assert all(m.weight.panels.dtype == torch.bfloat16 for m in layer.self_attn.matmuls())
    assert runner.model.fixed_lm_head.weight.panels.dtype == torch.bfloat16
    assert runner.model.model.embed_tokens.bf16.dtype == torch.bfloat16
    assert layer.input_layernorm.weight.dtype == torch.float32


def next_tokens(tiny: Path, dtype: str) -> list[tuple[int, dict[int, float]]]:
    """Each prompt's greedy next token and the float32-or-not top-5 logprobs it was picked from."""
    llm = LLM(model=str(tiny), dtype=dtype, device="cpu", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    out = []
    for result in llm.generate(PROMPTS, params):
        logprob = result.outputs[0].logprobs
        assert logprob is not None
        out.append((result.outputs[0].token_ids[0], dict(logprob[0].top)))
    return out


def test_a_bf16_model_picks_float32_s_next_token_or_one_float32_rates_as_nearly_as_likely(
    tiny: Path,
) -> None:
    """bf16 rounds every weight and activation to 8 bits of mantissa (relative error 2^-9 each), so
    where float32's two best tokens are closer than that noise carried through the layers, bf16 may
    pick the other. Asked: most next tokens agree (at least 12 of 16), and any that does not is in
    float32's top 5 within 0.5 nats of its best (a near tie, not a broken model)."""
    fp32, bf16 = next_tokens(tiny, "float32"), next_tokens(tiny, "bfloat16")
    agree = 0
    for (want, top), (got, _) in zip(fp32, bf16, strict=True):
        if got == want:
            agree += 1
            continue
        assert got in top, f"bf16 picked {got}, outside float32's top 5 {top}"
        assert top[want] - top[got] < 0.5, (want, got, top)
    assert agree >= 12, f"{agree} of {len(PROMPTS)} next tokens agree"
    assert all(math.isfinite(lp) for _, top in bf16 for lp in top.values())
