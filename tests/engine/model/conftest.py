"""Tiny random Hugging Face checkpoints made with transformers itself: the numerical reference.

Each is a real folder written by ``save_pretrained`` (config.json, safetensors, index when
sharded) plus the tiny model's byte-level tokenizer files, so kvfleet loads exactly what a
user would hand it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from kvfleet.engine.testing.tiny import BOS_ID, EOS_ID, PAD_ID, build_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Prompts of the byte-level tiny tokenizer (256 is <s>): short, one-block, long and block-crossing.
PROMPTS = [
    [256, 72, 101, 108, 108, 111],
    [256, 1, 2, 3],
    [256] + list(range(40, 69)),
    [256, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211],
]


def model_shape(
    hidden_size: int, intermediate_size: int, num_hidden_layers: int, **more: Any
) -> dict[str, Any]:
    """A transformers config's size keywords over the tiny byte-level vocabulary (256 bytes and 3 specials)."""
    return dict(
        vocab_size=259,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        **more,
    )


COMMON = model_shape(
    64,
    160,
    2,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)
VARIANTS: dict[str, Any] = {
    # GQA (4 query heads over 2 KV heads), llama3 rope scaling, untied, written as shards.
    "llama-gqa-llama3-sharded": lambda: LlamaConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    ),
    # Mistral: one KV head for four query heads, a head_dim wider than hidden/heads, a sliding window.
    "mistral-mqa": lambda: MistralConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=128
    ),
    # Qwen2: q/k/v biases, tied embeddings, full multi-head attention.
    "qwen2-tied": lambda: Qwen2Config(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        use_sliding_window=False,
    ),
}
# A window of 6 keys on layer 1 only (layers from max_window_layers=1 on slide), as Qwen2 and Qwen3 name it.
LAYER1_WINDOW: dict[str, Any] = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    use_sliding_window=True,
    sliding_window=6,
    max_window_layers=1,
)
# Rope scaling past a short original context (32 positions), so the test prompts reach beyond it.
SHORT: dict[str, Any] = {
    **COMMON,
    "max_position_embeddings": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
VARIANTS |= {
    "llama-rope-linear": lambda: LlamaConfig(**SHORT, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-rope-dynamic": lambda: LlamaConfig(**SHORT, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "llama-rope-yarn": lambda: LlamaConfig(
        **{**SHORT, "max_position_embeddings": 128},
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),
    # A window of 7 keys (not a whole number of 4-token blocks) on every layer.
    "mistral-window": lambda: MistralConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=7
    ),
    "qwen2-window": lambda: Qwen2Config(**COMMON, **LAYER1_WINDOW),
}
# Qwen3: q/k norms, a head_dim (32) apart from hidden/heads (16), no biases, a window of 6 keys on layer 1.
VARIANTS["qwen3-window"] = lambda: Qwen3Config(**COMMON, **LAYER1_WINDOW, head_dim=32)
# Gemma 3: a sliding layer (window 6, local rotary base 10^4) then a global one (10^6), q/k norms,
# head_dim 32, query_pre_attn_scalar 24 (not head_dim: the scale is its own), tied embeddings.
VARIANTS["gemma3-window"] = lambda: Gemma3TextConfig(
    **COMMON,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    sliding_window=6,
    layer_types=["sliding_attention", "full_attention"],
    query_pre_attn_scalar=24,
)
SHARD_SIZE = "100KB"


def write_tokenizer(folder: Path, scratch: Path) -> None:
    scratch.mkdir(parents=True, exist_ok=True)
    build_tiny_model(scratch)
    for name in TOKENIZER_FILES:
        shutil.copy(scratch / name, folder / name)


# Draws that make weights transformers initialises at a constant count: (name suffixes, mean, std).
Draw = tuple[str | tuple[str, ...], float, float]
QK_NORMS: Draw = (("q_norm.weight", "k_norm.weight"), 1.0, 0.3)  # norms start at one
GEMMA_NORMS: Draw = ("norm.weight", 0.0, 0.3)  # Gemma's norms scale by 1 + w, w starting at 0
BIASES: Draw = ("bias", 0.0, 0.2)  # biases start at zero


def save_checkpoint(
    config: Any, folder: Path, name: str, draws: tuple[Draw, ...] = (), seed: int = 0, shard: str = "50GB"
) -> Path:
    """transformers' model of ``config`` (seeded) saved in ``folder`` with the tiny tokenizer; each
    parameter takes the first of ``draws`` whose suffix its name ends with, in the model's order."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            draw = next((d for d in draws if param_name.endswith(d[0])), None)
            if draw is not None:
                p.normal_(draw[1], draw[2])
    model.save_pretrained(folder, max_shard_size=shard, safe_serialization=True)
    write_tokenizer(folder, folder.parent / f"{name}-tok-scratch")
    return folder


def make_checkpoint(variant: str, folder: Path) -> Path:
    families = {"qwen2": BIASES, "qwen3": QK_NORMS, "gemma3": GEMMA_NORMS}
    draws = tuple(d for family, d in families.items() if family in variant)
    shard = SHARD_SIZE if "sharded" in variant else "50GB"
    return save_checkpoint(VARIANTS[variant](), folder, variant, draws, shard=shard)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``KVFLEET_CACHE`` for the test: what it converts or downloads lands here."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KVFLEET_CACHE", str(root))
    return root


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {v: make_checkpoint(v, root / v) for v in VARIANTS}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    build_tiny_model(folder)
    return folder


def _hf_greedy(folder: Path, prompt: list[int], max_new_tokens: int, fresh: bool = False) -> list[int]:
    """transformers' own greedy ``generate`` on one unpadded prompt, EOS not stopping it.

    ``fresh``: a newly loaded model, for rope types whose module keeps state between calls
    (dynamic rope keeps the frequencies of the longest sequence seen until a short one)."""
    model = (
        AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        if fresh
        else load_hf(folder)
    )
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=PAD_ID,
    )
    return [int(t) for t in out[0, len(prompt) :]]


_HF_CACHE: dict[Path, Any] = {}


def load_hf(folder: Path) -> Any:
    if folder not in _HF_CACHE:
        _HF_CACHE[folder] = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return _HF_CACHE[folder]


@pytest.fixture(scope="session")
def hf_greedy() -> Any:
    """``hf_greedy(folder, prompt_ids, n, fresh=False)``: the reference tokens."""
    return _hf_greedy


@pytest.fixture(scope="session")
def hf_model() -> Any:
    """``hf_model(folder)``: the transformers model itself (for logits)."""
    return load_hf
