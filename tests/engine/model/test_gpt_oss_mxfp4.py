"""MXFP4 expert weights (``loader/mxfp4.py``): dequantized as the format defines them (a hand-computed
table), as transformers' own ``convert_moe_packed_tensors`` does, packed and unpacked round trip,
and a gpt-oss checkpoint stored packed loads into the very weights of its float form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from kvfleet.engine.loader import mxfp4
from kvfleet.engine.loader.hf_loader import load_model
from kvfleet.engine.model.config import ModelLoadError

from .gpt_oss_checkpoints import make_gpt_oss_checkpoint, pack_checkpoint


def test_dequantize_reads_each_nibble_low_first_under_its_groups_power_of_two() -> None:
    # one row of one 32-value group: byte j holds values 2j (low nibble) and 2j + 1 (high nibble)
    codes = list(range(16)) + [0x7, 0xF, 0x1, 0x9] + [0] * 12  # 0..15, +6, -6, +0.5, -0.5, zeros
    blocks = torch.tensor([[[codes[2 * j] | codes[2 * j + 1] << 4 for j in range(16)]]], dtype=torch.uint8)
    scales = torch.tensor([[127 + 2]], dtype=torch.uint8)  # 2^2
    got = mxfp4.dequantize(blocks, scales, torch.float32)[0]
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6, 6, -6, 0.5, -0.5] + [0] * 12
    assert got.tolist() == [4.0 * v for v in table]
    half = mxfp4.dequantize(blocks, torch.tensor([[126]], dtype=torch.uint8), torch.float32)[0]
    assert half[:8].tolist() == [0, 0.25, 0.5, 0.75, 1, 1.5, 2, 3]


def test_the_checkpoint_tensor_equals_transformers_own_dequantization() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), dtype=torch.uint8, generator=gen)  # E, out, G, 16
    scales = torch.randint(118, 134, (3, 10, 2), dtype=torch.uint8, generator=gen)
    ours = mxfp4.checkpoint_tensor(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == (3, 64, 10) and torch.equal(ours, theirs)


def test_packing_is_exact_for_values_on_the_grid_and_within_a_step_elsewhere() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4, 6, 96, generator=gen) * torch.logspace(-3, 2, 6)[None, :, None]
    blocks, scales = mxfp4.pack(w)
    assert blocks.shape == (4, 6, 3, 16) and scales.shape == (4, 6, 3)
    snapped = mxfp4.dequantize(blocks, scales, torch.float32)
    # values on the grid pack back to themselves (the bytes may differ: -0 is 0, and a group whose
    # peak is 3 * 2^k is 6 * 2^(k-1) as well)
    assert torch.equal(mxfp4.dequantize(*mxfp4.pack(snapped), torch.float32), snapped)
    # each group's largest magnitude lands on at most 6 steps of its scale, each value within half a step
    step = torch.ldexp(torch.ones(scales.shape), scales.int() - 127)[..., None]
    err = (snapped - w).unflatten(-1, (-1, 32)).abs()
    assert bool((err <= step * 1.0 + 1e-12).all())


def test_bad_blocks_and_scales_are_refused_naming_the_shapes() -> None:
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.dequantize(torch.zeros(1, 16), torch.zeros(1, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match=r"blocks \(2, 16\) must be scales' shape \(3,\)"):
        mxfp4.dequantize(
            torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8), torch.float32
        )
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.pack(torch.zeros(2, 40))


def test_a_packed_gpt_oss_checkpoint_loads_into_the_weights_of_its_float_form(tmp_path: Path) -> None:
    float_dir = make_gpt_oss_checkpoint(tmp_path / "float")
    packed_dir = pack_checkpoint(float_dir, tmp_path / "mxfp4")
    assert (
        json.loads((packed_dir / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    )
    cpu = torch.device("cpu")
    plain = load_model(float_dir, torch.float32, cpu).state_dict()
    packed = load_model(packed_dir, torch.float32, cpu).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in packed)
    assert plain.keys() == packed.keys()
    for name, tensor in plain.items():
        assert torch.equal(tensor, packed[name]), name


def test_a_packed_tensor_with_a_wrong_shape_is_refused_naming_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    packed_dir = pack_checkpoint(make_gpt_oss_checkpoint(tmp_path / "float"), tmp_path / "mxfp4")
    path = packed_dir / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :1].contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj"):
        load_model(packed_dir, torch.float32, torch.device("cpu"))


def test_transformers_reads_our_packed_checkpoint_into_the_float_forms_weights(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    float_dir = make_gpt_oss_checkpoint(tmp_path / "float")
    packed_dir = pack_checkpoint(float_dir, tmp_path / "mxfp4")
    plain = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).state_dict()
    dequantized = Mxfp4Config(dequantize=True)
    packed = AutoModelForCausalLM.from_pretrained(
        packed_dir, dtype=torch.float32, quantization_config=dequantized
    ).state_dict()
    assert plain.keys() == packed.keys()
    for name, tensor in plain.items():
        assert torch.equal(tensor, packed[name]), name


def test_an_engine_serves_a_packed_checkpoint_with_the_tokens_of_its_float_form(tmp_path: Path) -> None:
    from kvfleet.engine import LLM, SamplingParams

    float_dir = make_gpt_oss_checkpoint(tmp_path / "float")
    packed_dir = pack_checkpoint(float_dir, tmp_path / "mxfp4")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["hello world", "the capital of France is", "1 2 3 4"]
    tokens = []
    for folder in (float_dir, packed_dir):
        llm = LLM(str(folder), device="cpu", num_kv_blocks=64)
        try:
            assert llm.engine.runner.quantization.method == "float"  # dequantized at load, served as floats
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
        finally:
            llm.close()
    assert tokens[0] == tokens[1]
