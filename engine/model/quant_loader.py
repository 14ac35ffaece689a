"""A GGUF checkpoint served with its linear weights kept in their blocks (detected, or ``--quantization gguf``).

Where it sits: ``model/loaders.py`` calls :func:`load_quantized_model` when the engine's quantization
config (``layers/linear/config.py``) says the checkpoint is GGUF. The model is built on the meta
device; its norms (and any float tensor of the file) are materialised in float32; every linear
(q/k/v, o_proj, gate/up, down_proj, the LM head) is read from the .gguf file as raw block rows and
handed to the GGUF linear method (``layers/linear/gguf_blocks.py``), whose resolved matmul its block
calls; the embedding looks its rows up in the blocks and dequantises only those (where the LM head
is tied to it, in the head's packed blocks: one copy of that matrix). The nn.Linear parameters stay on the meta device: they
hold nothing. q/k/v (and gate/up) run as one matmul of their block rows stacked where they
share a format, else as one call each. A decode step runs every layer in one native call
(``fused_decode.py``) where each layer's four matmuls are native :class:`QuantLinear` callables (q/k/v
and gate/up of one format each); a file mixing formats within them runs the per-op path. A
mixture-of-experts file's (llama.cpp's ``qwen3moe``) stacked expert tensors are cut into each
expert's rows of blocks and run grouped (``layers/moe``: ``KernelExperts`` over the same method);
its router is float32, and it runs op by op.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from gguf import ReaderTensor
from gguf.quants import dequantize
from torch import nn

from kvfleet.engine.kernels.native.quant_gemm import BLOCK_LAYOUTS, QuantWeight
from kvfleet.engine.layers.linear.config import GgufModel
from kvfleet.engine.layers.linear.gguf_blocks import GgufMethod, QuantEmbedding, Weight
from kvfleet.engine.layers.moe import KernelExperts
from kvfleet.engine.model.config import ModelLoadError
from kvfleet.engine.model.gguf_convert import hf_name, norm_shift, permuted_qk, read_gguf, unpermute_qk
from kvfleet.engine.model.llama import MLP, DecoderLayer, LlamaForCausalLM
from kvfleet.engine.model.loader import build_model, load_config
from kvfleet.engine.model.moe import SparseMoeBlock
from kvfleet.engine.model.projections import Matmuls
from kvfleet.engine.model.resident import resident_weight_bytes
from kvfleet.engine.model.sources import SMOLLM2, gguf_source, smollm2_gguf

log = logging.getLogger(__name__)
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # llama.cpp's stacked experts
__all__ = [
    "QuantEmbedding",
    "load_quantized_model",
    "quantized_source",
    "read_weight",
    "resident_weight_bytes",
]


def quantized_source(model: str) -> Path:
    """The .gguf file whose blocks ``--model`` serves quantised (``smollm2``, a .gguf, a folder of one)."""
    if model == SMOLLM2:
        return smollm2_gguf()
    source = gguf_source(Path(model).expanduser())
    if source is None:
        raise ModelLoadError(
            f"{model}: --quantization gguf serves a GGUF checkpoint (a .gguf file or smollm2); "
            "this is a Hugging Face folder"
        )
    return source


def gguf_model(model: str, flag: str | None) -> GgufModel | None:
    """The GGUF file ``--model`` names, for the quantization config: by path (a .gguf, a folder of
    one), or ``smollm2``'s only under ``--quantization gguf`` (the alias serves the float conversion,
    transformers' weights, unless asked)."""
    if model == SMOLLM2:
        return GgufModel(smollm2_gguf(), by_path=False) if flag == "gguf" else None
    source = gguf_source(Path(model).expanduser())
    return None if source is None else GgufModel(source, by_path=True)


def load_quantized_model(
    model: str, folder: Path, dtype: torch.dtype, device: torch.device, path: Path | None = None
) -> LlamaForCausalLM:
    """The model of GGUF checkpoint ``model`` (converted to ``folder`` for its config), linears
    quantised; ``path``: its .gguf file where the quantization config found it already."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ModelLoadError(
            f"--quantization gguf runs on the CPU kernels in float32; got device {device}, dtype {dtype}"
        )
    path = path or quantized_source(model)
    method = GgufMethod(dtype)
    gguf = read_gguf(path)
    tensors = {t.name: t for t in gguf.tensors}
    config = load_config(folder)
    with torch.device("meta"):
        llama = build_model(config)
    llama.reset_buffers(device)
    permute = permuted_qk(gguf.arch)
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    for i, layer in enumerate(llama.model.layers):
        assert isinstance(layer, DecoderLayer)

        def weight(part: str, i: int = i) -> Weight:
            return read_weight(tensors[f"blk.{i}.{part}.weight"], heads.get(part) if permute else None)

        biases = [tensors.get(f"blk.{i}.{p}.bias") for p in ("attn_q", "attn_k", "attn_v")]
        qkv_bias = None if biases[0] is None else torch.cat([_floats(b) for b in biases if b is not None])
        layer.self_attn.fixed = Matmuls(
            method.load([weight("attn_q"), weight("attn_k"), weight("attn_v")], qkv_bias),
            method.load([weight("attn_output")], None),
        )
        ffn = layer.feed_forward()
        if isinstance(ffn, SparseMoeBlock):  # qwen3moe: the experts in their blocks, the router float32
            gates, ups, downs = (read_experts(tensors[f"blk.{i}.{p}.weight"]) for p in EXPERT_PARTS)
            ffn.fixed = KernelExperts.load(method, gates, ups, downs)
            router = _floats(tensors[f"blk.{i}.ffn_gate_inp.weight"]).reshape(ffn.gate.weight.shape)
            ffn.gate.weight = nn.Parameter(router, requires_grad=False)
        else:
            assert isinstance(ffn, MLP)
            ffn.fixed = Matmuls(
                method.load([weight("ffn_gate"), weight("ffn_up")], None),
                method.load([weight("ffn_down")], None),
            )
    _load_floats(llama, tensors, gguf.arch)
    embed = method.shared(read_weight(tensors["token_embd.weight"], None))  # the lookup's and a tied head's
    llama.model.embed_tokens = method.embedding(embed)
    head = tensors.get("output.weight")
    llama.fixed_lm_head = method.load([embed if head is None else read_weight(head, None)], None)
    log.info("quantized weights (gguf %s): %.1f MB resident", path.name, resident_weight_bytes(llama) / 1e6)
    return llama.eval()


def read_weight(t: ReaderTensor, permute_heads: int | None) -> Weight:
    """Tensor ``t`` as blocks (a quantised type the kernel takes) or float32, q/k rows unpermuted
    (whole rows of blocks move: exact)."""
    out, k = (int(d) for d in reversed(t.shape.tolist()))
    if int(t.tensor_type) in BLOCK_LAYOUTS:
        rows = np.asarray(t.data, dtype=np.uint8).reshape(out, -1)
        if permute_heads is not None:
            rows = unpermute_qk(rows, permute_heads)
        return QuantWeight(torch.from_numpy(np.array(rows, order="C", copy=True)), int(t.tensor_type), k)
    values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(out, k)
    if permute_heads is not None:
        values = unpermute_qk(values, permute_heads)
    return torch.from_numpy(np.ascontiguousarray(values))


def read_experts(t: ReaderTensor) -> list[Weight]:
    """A stacked (E, out, in) expert tensor as each expert's weight: its rows of blocks (a quantised
    type the kernel takes) or float32."""
    experts, out, k = (int(d) for d in reversed(t.shape.tolist()))
    if int(t.tensor_type) in BLOCK_LAYOUTS:
        rows = np.asarray(t.data, dtype=np.uint8).reshape(experts, out, -1)
        return [
            QuantWeight(torch.from_numpy(np.array(r, order="C", copy=True)), int(t.tensor_type), k)
            for r in rows
        ]
    values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(experts, out, k)
    return [torch.from_numpy(np.ascontiguousarray(v)) for v in values]


def _floats(t: ReaderTensor) -> torch.Tensor:
    return torch.from_numpy(
        np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1).copy()
    )


def _load_floats(model: LlamaForCausalLM, tensors: dict[str, ReaderTensor], arch: str) -> None:
    """Every norm weight from the file, float32 (the linears are the blocks': they are skipped)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in tensors.items():
        target = hf_name(name, arch)
        if target is None or not target.endswith("norm.weight"):
            continue
        if target not in params:
            raise ModelLoadError(f"{name}: no parameter {target} in the model")
        owner, leaf = target.rsplit(".", 1)
        values = (_floats(t) - norm_shift(arch, name)).reshape(params[target].shape)
        setattr(model.get_submodule(owner), leaf, nn.Parameter(values, requires_grad=False))
