"""A tiny random gpt-oss checkpoint made with transformers' own ``GptOssConfig``, in two forms: float,
and with its experts MXFP4-packed (``loader/mxfp4.py``'s packer) as gpt-oss's releases store them.

3 layers (sliding, full, sliding; a window of 8 keys, shorter than the test prompts), 4 query heads
over 2 KV heads of 16 (hidden/heads is 16 too; head_dim is read on its own), q/k/v/o biases,
attention sinks, YaRN rotary (factor 4 over 16 original positions, beta 32/1, truncate false as
gpt-oss), 8 experts of 64 columns with biases, 2 per token. The float checkpoint's expert weights
are those the packed form holds (rounded to MXFP4 first), so both forms are the same model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig

from kvfleet.engine.loader import mxfp4

from .conftest import BIASES, COMMON, save_checkpoint

YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
    "rope_theta": 150000.0,
}
EXPERTS = ("gate_up_proj", "down_proj")


def gpt_oss_config() -> GptOssConfig:
    shape = {**COMMON, "intermediate_size": 64, "num_hidden_layers": 3, "max_position_embeddings": 64}
    return GptOssConfig(
        **shape,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=YARN,
        attention_bias=True,
    )


def make_gpt_oss_checkpoint(folder: Path) -> Path:
    """The float form: transformers' model saved, its expert weights rounded to MXFP4's grid."""
    draws = (("router.weight", 0.0, 0.5), ("sinks", 0.0, 1.0), ("experts.gate_up_proj", 0.0, 0.2))
    draws += (("experts.down_proj", 0.0, 0.2), BIASES)
    save_checkpoint(gpt_oss_config(), folder, "gpt-oss", draws)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(EXPERTS)]:
        blocks, scales = mxfp4.pack(tensors[name].transpose(1, 2))
        tensors[name] = mxfp4.checkpoint_tensor(blocks, scales, torch.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def pack_checkpoint(float_folder: Path, folder: Path) -> Path:
    """The float checkpoint with every expert tensor stored as ``_blocks`` + ``_scales``, and
    config.json's ``quantization_config`` saying so, as gpt-oss's releases are."""
    folder.mkdir(parents=True)
    for src in float_folder.iterdir():
        if src.is_file() and src.name != "model.safetensors":
            (folder / src.name).write_bytes(src.read_bytes())
    tensors = load_file(float_folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(EXPERTS)]:
        blocks, scales = mxfp4.pack(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["router", "self_attn"],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
