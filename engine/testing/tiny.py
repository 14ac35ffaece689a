"""The embedded ``tiny`` model: a small random Llama written as a real Hugging Face folder.

Where it sits: ``--model tiny`` (the default) resolves through :func:`ensure_tiny_model`
to a folder in the cache, which the loader and tokenizer then read like any checkpoint,
so a fresh machine serves without downloads. The folder is built once, atomically
(written under a temporary name, then renamed), from a fixed seed with numpy's PCG64
generator and hand-written JSON, so every machine gets the same bytes.

The tokenizer is byte-level: ids 0..255 are the bytes (GPT-2's printable alphabet, no
merges), then ``<s>`` (256), ``</s>`` (257, EOS) and ``<pad>`` (258).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from kvfleet.engine.paths import cache_root
from kvfleet.engine.tokenizer.gguf import added_token
from kvfleet.engine.tokenizer.hf import _byte_decoder

TINY_VERSION = "v1"
TINY_SEED = 20240601
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "torch_dtype": "float32",
}


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """The tiny model's folder, building it on first use; safe when processes race to build it."""
    target = (cache_dir or cache_root()) / f"tiny-{TINY_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tiny-{TINY_VERSION}-", dir=target.parent))
    try:
        build_tiny_model(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tiny_model(folder: Path) -> None:
    """Write the five files of the tiny checkpoint into ``folder`` (which must exist)."""
    _write_json(folder / "config.json", TINY_CONFIG)
    _write_json(folder / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    _write_json(folder / "tokenizer.json", _tokenizer_json())
    _write_json(
        folder / "tokenizer_config.json",
        {
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "model_max_length": TINY_CONFIG["max_position_embeddings"],
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
        },
    )
    save_file(_weights(), str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _weights() -> dict[str, np.ndarray]:
    # Linear weights ~ N(0, 1/fan_in) (unit-variance activations), embeddings ~ N(0, 1),
    # norms at one: logits spread enough that greedy argmax never sits on a near-tie.
    c = TINY_CONFIG
    rng = np.random.Generator(np.random.PCG64(TINY_SEED))
    h, inter, vocab, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def linear(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f), dtype=np.float32) / np.float32(np.sqrt(in_f))).astype(
            np.float32
        )

    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, h), dtype=np.float32)
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        w[p + "self_attn.q_proj.weight"] = linear(q_out, h)
        w[p + "self_attn.k_proj.weight"] = linear(kv_out, h)
        w[p + "self_attn.v_proj.weight"] = linear(kv_out, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, q_out)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter)
    w["model.norm.weight"] = np.ones(h, dtype=np.float32)
    w["lm_head.weight"] = linear(vocab, h) * np.float32(4.0)
    return w


def _tokenizer_json() -> dict[str, Any]:
    vocab = {char: byte for char, byte in sorted(_byte_decoder().items(), key=lambda kv: kv[1])}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    bos = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added_token(BOS_ID, BOS), added_token(EOS_ID, EOS), added_token(PAD_ID, PAD)],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [BOS_ID], "tokens": [BOS]}},
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
