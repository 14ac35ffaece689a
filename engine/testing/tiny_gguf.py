"""The ``tiny`` model (``testing/tiny.py``) as a GGUF file: its config and tokenizer as metadata, any
state dict's tensors in a chosen ggml type, the q/k weights permuted as llama.cpp's converter does.

Where it sits: beside ``testing/tiny.py``, for the tests and benches that serve a GGUF checkpoint without
downloading one (``loader/gguf_convert.py`` and ``loader/gguf_loader.py`` read it back). Written with the
``gguf`` package's own writer, so the file is what llama.cpp's tools would produce.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np

from kvfleet.engine.testing.tiny import BOS, CHAT_TEMPLATE, EOS, PAD, TINY_CONFIG
from kvfleet.engine.tokenizer.hf import _byte_decoder

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# The tiny tokenizer's vocabulary in id order: the 256 bytes (GPT-2's alphabet), then its 3 special tokens.
TOKENS = [c for c, _ in sorted(_byte_decoder().items(), key=lambda kv: kv[1])] + [BOS, EOS, PAD]


class SentencePiece(NamedTuple):
    tokens: list[str]
    types: list[int]
    scores: list[float]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's ``LlamaModel.permute`` (for k, n_head is the KV head count)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's gemma3 names: a norm before and after the MLP, one after attention.
GEMMA3_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}

# llama.cpp's qwen3moe names: the router, and each layer's experts stacked (E, out, in) by
# :func:`stack_experts` under these names.
QWEN3MOE_LAYER_NAMES = LAYER_NAMES | {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
}
_ARCH_LAYER_NAMES = {"gemma3": GEMMA3_LAYER_NAMES, "qwen3moe": QWEN3MOE_LAYER_NAMES}


def stack_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """convert_hf_to_gguf's Qwen3-MoE experts: ``model.layers.L.mlp.experts.E.gate_proj.weight`` of
    every E stacked (E, out, in) as ``model.layers.L.mlp.experts.gate_proj.weight``."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, array in weights.items():
        parts = name.split(".")
        if len(parts) == 8 and parts[3:5] == ["mlp", "experts"]:
            stacks.setdefault(".".join(parts[:5] + parts[6:]), {})[int(parts[5])] = array
        else:
            out[name] = array
    return out | {name: np.stack([e[i] for i in sorted(e)]) for name, e in stacks.items()}


def _expert_meta(arch: str, config: dict[str, Any]) -> dict[str, Any]:
    if arch != "qwen3moe":
        return {}
    return {
        f"{arch}.expert_count": config.get("num_experts") or config["num_local_experts"],  # transformers 5
        f"{arch}.expert_used_count": config["num_experts_per_tok"],
        f"{arch}.expert_feed_forward_length": config["moe_intermediate_size"],
    }


def _rope_theta(config: dict[str, Any]) -> float:
    """The (global layers') rotary base, in either transformers spelling."""
    if config.get("rope_theta"):
        return float(config["rope_theta"])
    params = config["rope_parameters"]
    return float(params.get("full_attention", params)["rope_theta"])


def gguf_name(hf: str, layer_names: dict[str, str] | None = None) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{(layer_names or LAYER_NAMES)[rest]}"


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    skip: tuple[str, ...] = (),
    vocab: SentencePiece | None = None,
    rope_freqs: list[float] | None = None,
    config: dict[str, Any] | None = None,
    more: dict[str, Any] | None = None,
) -> Path:
    """The tiny model's config (or ``config``, a config.json over the tiny vocabulary) and tokenizer
    as GGUF metadata (and ``more`` fields), ``weights`` as tensors of ``qtype``; for ``gemma3`` under
    llama.cpp's names, every norm stored as 1 + w as its converter stores them; for ``qwen3moe`` the
    expert metadata, each layer's experts stacked and the router left float32 as llama.cpp does."""
    C = TINY_CONFIG if config is None else config
    w = gguf.GGUFWriter(str(path), arch)
    meta: dict[str, Any] = {
        f"{arch}.context_length": C["max_position_embeddings"],
        f"{arch}.embedding_length": C["hidden_size"],
        f"{arch}.block_count": C["num_hidden_layers"],
        f"{arch}.feed_forward_length": C["intermediate_size"],
        f"{arch}.attention.head_count": C["num_attention_heads"],
        f"{arch}.attention.head_count_kv": C["num_key_value_heads"],
        f"{arch}.rope.freq_base": _rope_theta(C),
        f"{arch}.attention.layer_norm_rms_epsilon": float(C["rms_norm_eps"]),
    }
    if C.get("head_dim"):  # written by convert_hf_to_gguf where the config names it
        meta[f"{arch}.attention.key_length"] = C["head_dim"]
        meta[f"{arch}.attention.value_length"] = C["head_dim"]
    for key, value in (meta | _expert_meta(arch, C) | (more or {})).items():
        if key not in skip:
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    if vocab is None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(TOKENS)
        w.add_token_types([1] * 256 + [3] * 3)
        w.add_bos_token_id(256)
        w.add_eos_token_id(257)
        w.add_pad_token_id(258)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list(vocab.tokens)
        w.add_token_types(vocab.types)
        w.add_token_scores(vocab.scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    heads, kv_heads = C["num_attention_heads"], C["num_key_value_heads"]
    names = _ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)
    for name, array in (stack_experts(weights) if arch == "qwen3moe" else weights).items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = permute(array, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute(array, kv_heads)
        router = name.endswith("mlp.gate.weight")  # llama.cpp never quantises ffn_gate_inp
        if array.ndim >= 2 and not router and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name, names), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(
                gguf_name(name, names), np.ascontiguousarray(array)
            )  # float32 (or a test's own type)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
