"""``--quantization int8``/``fp8`` on Hugging Face checkpoints, and compressed-tensors checkpoints
loaded as they are (engine/loader/hf_quant.py, engine/layers/linear/checkpoint.py), on the CPU.

The tiny model served int8 must keep most greedy tokens of the float32 model (its weights are
random: near-tied logits flip under int8's error, so the share of prompts whose next greedy token
agrees, not equality, is asserted and printed); FP8 is tested as far as a CPU goes: the e4m3 rounding, detection, and an FP8 checkpoint
dequantised at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.kernels.fp8_linear import E4M3, quantize_fp8_per_channel, resolve_fp8_linear
from kvfleet.engine.kernels.int8_linear import Int8Linear
from kvfleet.engine.kernels.linear import TorchLinear
from kvfleet.engine.kernels.native.int8_gemm import load_int8, quantize_per_channel
from kvfleet.engine.layers.linear.checkpoint import checkpoint_quantization, scheme_of
from kvfleet.engine.loader.hf_quant import Int8Embedding, resident_weight_bytes, serving_target
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.model.llama import DecoderLayer
from kvfleet.engine.testing.tiny import ensure_tiny_model

CPU = torch.device("cpu")
# 48 prompts of 3 to 10 ids; each one's first greedy token is compared: a later token depends on
# the earlier ones, so after one flip (near-tied logits of random weights) a whole tail differs
PROMPTS = [
    torch.randint(3, 259, (3 + i % 8,), generator=torch.Generator().manual_seed(i)).tolist()
    for i in range(48)
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def ct_config(kind: str) -> dict[str, object]:
    weights = {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True}
    group = {"weights": weights, "input_activations": {"num_bits": 8, "type": kind, "dynamic": True}}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


def greedy_tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module")
def float_tokens() -> list[list[int]]:
    return greedy_tokens(LLM("tiny", num_kv_blocks=32))


def test_e4m3_per_channel_quantisation_matches_torchs_own_cast() -> None:
    w = torch.randn(32, 64) * torch.logspace(-3, 1, 32)[:, None]
    q = quantize_fp8_per_channel(w)
    scale = w.abs().amax(dim=1) / 448.0
    assert torch.equal(q.scale, scale)
    assert torch.equal(q.qweight, (w / scale[:, None]).to(E4M3))
    assert q.qweight.float().abs().amax(dim=1).eq(448.0).all()
    rel = ((q.dequantised(torch.float32) - w).abs() / w.abs().clamp(min=1e-6 * scale[:, None])).median()
    assert rel < 2**-4  # e4m3: 3 mantissa bits


def test_fp8_on_the_cpu_runs_dequantised_to_the_compute_dtype() -> None:
    linear = resolve_fp8_linear(quantize_fp8_per_channel(torch.randn(16, 32)), None, torch.float32)
    assert isinstance(linear, TorchLinear) and linear.weight.dtype == torch.float32


def test_compressed_tensors_schemes_are_detected_and_others_refused() -> None:
    assert scheme_of(ct_config("float"), "x") == "fp8"
    assert scheme_of(ct_config("int"), "x") == "int8"
    assert scheme_of(None, "x") is None
    with pytest.raises(ModelLoadError, match="'awq' is not served"):
        scheme_of({"quant_method": "awq"}, "x")
    four_bit = ct_config("int")
    four_bit["config_groups"]["group_0"]["weights"]["num_bits"] = 4  # type: ignore[index]
    with pytest.raises(ModelLoadError, match="int 4-bit"):
        scheme_of(four_bit, "x")
    assert checkpoint_quantization(ensure_tiny_model()) is None


def test_fp8_on_the_cpu_is_refused_naming_what_works_there() -> None:
    with pytest.raises(ModelLoadError, match="--quantization fp8 needs a GPU.*int8.*gguf"):
        serving_target("fp8", None, CPU)
    with pytest.raises(ModelLoadError, match="asked of a compressed-tensors fp8"):
        serving_target("int8", "fp8", CPU)
    assert serving_target(None, "fp8", CPU) == "float"
    assert serving_target(None, "int8", CPU) == serving_target("int8", None, CPU) == "int8"


@pytest.mark.skipif(load_int8() is None, reason="the native library does not build here")
def test_tiny_served_int8_keeps_most_greedy_tokens_in_a_quarter_of_the_bytes(
    float_tokens: list[list[int]],
) -> None:
    llm = LLM("tiny", quantization="int8", num_kv_blocks=32)
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp.matmuls().inputs, Int8Linear)
    assert isinstance(model.model.embed_tokens, Int8Embedding) and model.fused_decode() is not None
    floats = sum(p.numel() for p in LLM("tiny", num_kv_blocks=32).engine.runner.model.parameters()) * 4
    resident = resident_weight_bytes(model)
    share = agreement(float_tokens, greedy_tokens(llm))
    print(f"\ntiny int8: {resident} weight bytes resident (float32 {floats}); greedy agreement {share:.0%}")
    assert resident < floats * 0.3
    assert share >= 0.8


def write_compressed_tensors(folder: Path, kind: str) -> None:
    """The tiny checkpoint re-saved as llm-compressor would: linears quantised per channel, lm_head kept."""
    src = ensure_tiny_model()
    shutil.copytree(src, folder)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = ct_config(kind)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            q = quantize_per_channel(t) if kind == "int" else quantize_fp8_per_channel(t)
            out[name], out[name + "_scale"] = q.qweight, q.scale[:, None]
        else:
            out[name] = t
    save_file(out, str(folder / "model.safetensors"))


@pytest.mark.parametrize("kind", ["int", "float"])
def test_a_compressed_tensors_checkpoint_loads_as_it_is_and_generates(
    kind: str, tmp_path: Path, float_tokens: list[list[int]]
) -> None:
    if kind == "int" and load_int8() is None:
        pytest.skip("the native library does not build here")
    write_compressed_tensors(tmp_path / "ct", kind)
    llm = LLM(str(tmp_path / "ct"), num_kv_blocks=32)
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    inputs = layer.self_attn.matmuls().inputs
    if kind == "int":
        assert isinstance(inputs, Int8Linear)
    else:  # FP8 on the CPU: dequantised at load to float32, a float linear like any other
        assert getattr(inputs, "weight").dtype == torch.float32  # noqa: B009
    share = agreement(float_tokens, greedy_tokens(llm))
    print(f"\ncompressed-tensors {kind}8 on the CPU: greedy agreement {share:.0%}")
    assert share >= (0.8 if kind == "int" else 0.6)  # e4m3 keeps 3 mantissa bits, int8 about 7
