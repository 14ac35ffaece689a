"""Rope scaling and sliding windows as config.json states them, against transformers' own reading:
the inverse frequencies and cos/sin scale bit for bit, the windows per layer, the served context,
and a clear error for what is not supported."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, _compute_dynamic_ntk_parameters

from kvfleet.engine.model.config import ModelConfig, ModelLoadError
from kvfleet.engine.model.rope import dynamic_inv_freq, rope_frequencies

from .conftest import model_shape

SHAPE = model_shape(128, 64, 4, num_attention_heads=4, num_key_value_heads=4)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": YARN,
    "yarn-betas": {**YARN, "beta_fast": 16, "beta_slow": 2},
    "yarn-mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-attention-factor": {**YARN, "attention_factor": 0.9},
    "yarn-untruncated": {**YARN, "truncate": False},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def hf_llama(rope: dict[str, Any], max_positions: int = 256) -> LlamaConfig:
    return LlamaConfig(
        **SHAPE,
        max_position_embeddings=max_positions,
        rope_scaling=dict(rope),
        architectures=["LlamaForCausalLM"],
    )


def ours(hf_config: Any) -> ModelConfig:
    return ModelConfig.from_dict(hf_config.to_dict())


@pytest.mark.parametrize("name", list(ROPES))
def test_inverse_frequencies_and_cos_sin_scale_equal_transformers_bit_for_bit(name: str) -> None:
    rope = ROPES[name]
    hf = hf_llama(rope)
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, torch.device("cpu"))
    got = rope_frequencies(ours(hf))
    assert got.inv_freq.dtype == torch.float32
    assert torch.equal(got.inv_freq, inv_freq)
    assert got.attention_scaling == scale


@pytest.mark.parametrize("seq_len", [257, 300, 1000])
def test_dynamic_frequencies_past_the_original_length_equal_the_ones_transformers_recomputes(
    seq_len: int,
) -> None:
    hf = hf_llama(ROPES["dynamic"])
    # transformers' forward passes its largest position + 1 as a 0-d int64 tensor
    theirs, _ = _compute_dynamic_ntk_parameters(hf, torch.device("cpu"), seq_len=torch.tensor(seq_len))
    got = dynamic_inv_freq(ours(hf), seq_len)
    assert torch.equal(got, theirs)
    assert not torch.equal(got, rope_frequencies(ours(hf)).inv_freq)


@pytest.mark.parametrize(
    ("rope", "max_model_len"),
    [
        (ROPES["linear"], 640),  # 256 x 2.5
        (ROPES["dynamic"], 512),  # 256 x 2
        (YARN, 256),  # original 64 x 4
        ({**YARN, "original_max_position_embeddings": 256}, 1024),
        (ROPES["llama3"], 256),  # llama3 checkpoints state the stretched length themselves
    ],
)
def test_the_served_context_is_the_length_the_rope_scaling_stretches_to(
    rope: dict[str, Any], max_model_len: int
) -> None:
    assert ours(hf_llama(rope)).max_model_len == max_model_len


def test_qwen2_windows_the_layers_transformers_marks_sliding() -> None:
    for kwargs in (
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=3),
        dict(use_sliding_window=False, sliding_window=6, max_window_layers=1),
        dict(
            use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2
        ),
    ):
        hf = Qwen2Config(**SHAPE, architectures=["Qwen2ForCausalLM"], **kwargs)
        expected = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
        assert ours(hf).layer_windows == expected
    raw = Qwen2Config(**SHAPE, architectures=["Qwen2ForCausalLM"]).to_dict()
    raw |= {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2}
    del raw["layer_types"]  # a config.json from before transformers wrote layer_types
    assert ModelConfig.from_dict(raw).layer_windows == (None, None, 6, 6)


def test_mistral_windows_every_layer_and_llama_none() -> None:
    mistral = MistralConfig(**SHAPE, sliding_window=7, architectures=["MistralForCausalLM"])
    assert ours(mistral).layer_windows == (7, 7, 7, 7)
    assert (
        ours(MistralConfig(**SHAPE, sliding_window=None, architectures=["MistralForCausalLM"])).layer_windows
        == (None,) * 4
    )
    llama = {**hf_llama(ROPES["linear"]).to_dict(), "sliding_window": 7}  # LlamaConfig has no window
    assert ModelConfig.from_dict(llama).layer_windows == (None,) * 4


def raw_llama(**changes: Any) -> dict[str, Any]:
    return {**hf_llama(ROPES["linear"]).to_dict(), **changes}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            raw_llama(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
            "rope_scaling type 'longrope' is not supported; supported: "
            "['default', 'linear', 'dynamic', 'yarn', 'llama3']",
        ),
        (
            raw_llama(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
            "rope_scaling of type 'linear' needs field 'factor', which is missing",
        ),
        (
            raw_llama(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
            "partial_rotary_factor=0.5 is not supported; only 1.0 (rope on every dim)",
        ),
        (
            {**raw_llama(), "architectures": ["MistralForCausalLM"], "sliding_window": 0},
            "sliding_window=0 must be a positive integer (tokens) or null",
        ),
        (
            {
                **raw_llama(),
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 8,
            }
            | {"layer_types": ["sliding_attention"] * 3},
            "layer_types has 3 entries, num_hidden_layers=4",
        ),
    ],
)
def test_an_unsupported_rope_or_window_is_a_load_error_naming_the_value(
    raw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict(raw, source="ckpt/config.json")
    assert str(e.value) == f"ckpt/config.json: {message}"


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_the_rope_buffer_sits_on_the_device_the_model_is_built_on(rope: str) -> None:
    """``with torch.device("cuda"): LlamaForCausalLM(...)`` (bench/gpu/gpu_decode.py) put every weight on
    the GPU but left ``inv_freq`` on the CPU; meta stands in for the GPU here."""
    from kvfleet.engine.model.llama import RotaryEmbedding

    scaling = {"rope_type": "default"} if rope == "default" else ROPES["llama3"]
    config = ModelConfig.from_dict(raw_llama(rope_parameters=scaling))
    with torch.device("meta"):
        built = RotaryEmbedding(config)
    assert built.inv_freq.device.type == "meta"
    assert RotaryEmbedding(config).inv_freq.device.type == "cpu"
