"""``--quantization gguf``: a GGUF checkpoint served with its linear weights kept in their blocks.

Where it sits: ``ModelRunner`` calls :func:`load_quantized_model` in place of ``loader.load_model``
when ``EngineConfig.quantization == "gguf"``. The model is built on the meta device; its norms
(and any float tensor of the file) are materialised in float32; every linear (q/k/v, o_proj,
gate/up, down_proj, the LM head) is read from the .gguf file as raw block rows and handed to its
block as a resolved callable (``kernels/quant_linear.py``); the embedding looks its rows up in
the blocks and dequantises only those (where the LM head is tied to it, in the head's packed
blocks: one copy of that matrix). The nn.Linear parameters stay on the meta device: they
hold nothing. q/k/v (and gate/up) run as one matmul of their block rows stacked where they
share a format, else as one call each. A decode step runs every layer in one native call
(``fused_decode.py``) where each layer's four matmuls are native :class:`QuantLinear` callables (q/k/v
and gate/up of one format each); a file mixing formats within them runs the per-op path.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize
from torch import nn

from kvfleet.engine.kernels.linear import Linear, resolve_linear
from kvfleet.engine.kernels.native.quant_gemm import BLOCK_LAYOUTS, PackedQuant, QuantWeight
from kvfleet.engine.kernels.quant_linear import ConcatLinear, concat_rows, packed, resolve_quant_linear
from kvfleet.engine.model.config import ModelLoadError
from kvfleet.engine.model.gguf_convert import PERMUTED_QK, hf_name, read_gguf, unpermute_qk
from kvfleet.engine.model.llama import DecoderLayer, LlamaForCausalLM
from kvfleet.engine.model.loader import load_config
from kvfleet.engine.model.projections import Matmuls
from kvfleet.engine.model.resident import resident_weight_bytes
from kvfleet.engine.model.sources import SMOLLM2, gguf_source, smollm2_gguf

log = logging.getLogger(__name__)
# the file's blocks, blocks packed for the kernel, or float32 (out, in) where the file stores floats
Weight = QuantWeight | PackedQuant | torch.Tensor


class QuantEmbedding(nn.Embedding):
    """The token embedding looked up in GGUF blocks: only the rows a step reads are dequantised."""

    def __init__(self, weight: QuantWeight | PackedQuant) -> None:
        n, k = weight.out_features, weight.in_features
        super().__init__(n, k, _weight=torch.empty(n, k, device="meta"))
        self.blocks = weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ids = input.reshape(-1).cpu()
        rows = self.blocks.rows(ids)
        if self.blocks.ggml_type == 8:  # Q8_0, the common embedding format: f16 scale, 32 int8
            per_row = self.blocks.in_features // 32
            blocks = rows.reshape(-1, per_row, 34)
            scale = blocks[:, :, :2].contiguous().view(torch.float16).float()
            values = blocks[:, :, 2:].contiguous().view(torch.int8).float() * scale
        else:
            values = torch.from_numpy(
                dequantize(rows.numpy(), GGMLQuantizationType(self.blocks.ggml_type)).astype(np.float32)
            )
        return values.reshape(*input.shape, self.blocks.in_features).to(input.device)


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


def load_quantized_model(
    model: str, folder: Path, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The model of GGUF checkpoint ``model`` (converted to ``folder`` for its config), linears quantised."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ModelLoadError(
            f"--quantization gguf runs on the CPU kernels in float32; got device {device}, dtype {dtype}"
        )
    path = quantized_source(model)
    gguf = read_gguf(path)
    tensors = {t.name: t for t in gguf.tensors}
    config = load_config(folder)
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    llama.model.rotary_emb.reset_buffers(device)
    permute = gguf.arch in PERMUTED_QK
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    for i, layer in enumerate(llama.model.layers):
        assert isinstance(layer, DecoderLayer)

        def weight(part: str, i: int = i) -> Weight:
            return read_weight(tensors[f"blk.{i}.{part}.weight"], heads.get(part) if permute else None)

        biases = [tensors.get(f"blk.{i}.{p}.bias") for p in ("attn_q", "attn_k", "attn_v")]
        qkv_bias = None if biases[0] is None else torch.cat([_floats(b) for b in biases if b is not None])
        layer.self_attn.fixed = Matmuls(
            linear_of([weight("attn_q"), weight("attn_k"), weight("attn_v")], qkv_bias),
            linear_of([weight("attn_output")], None),
        )
        layer.mlp.fixed = Matmuls(
            linear_of([weight("ffn_gate"), weight("ffn_up")], None), linear_of([weight("ffn_down")], None)
        )
    _load_floats(llama, tensors)
    embed = read_weight(tensors["token_embd.weight"], None)
    if isinstance(embed, QuantWeight):
        embed = packed(embed)  # shared by the lookup and a tied LM head
        llama.model.embed_tokens = QuantEmbedding(embed)
    head = tensors.get("output.weight")
    llama.fixed_lm_head = linear_of([embed if head is None else read_weight(head, None)], None)
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


def linear_of(weights: list[Weight], bias: torch.Tensor | None) -> Linear:
    """The linears ``weights`` (outputs side by side) as one resolved callable."""
    raw = [w for w in weights if isinstance(w, QuantWeight)]
    if len(raw) == len(weights):
        stacked = concat_rows(raw)
        if stacked is not None:
            return resolve_quant_linear(stacked, bias)
    floats = [w for w in weights if isinstance(w, torch.Tensor)]
    if len(floats) == len(weights):
        return resolve_linear(torch.cat(floats).contiguous(), bias)
    parts: list[Linear] = []
    row = 0
    for w in weights:
        rows = w.shape[0] if isinstance(w, torch.Tensor) else w.out_features
        b = None if bias is None else bias[row : row + rows].contiguous()
        parts.append(resolve_linear(w, b) if isinstance(w, torch.Tensor) else resolve_quant_linear(w, b))
        row += rows
    return parts[0] if len(parts) == 1 else ConcatLinear(tuple(parts))


def _floats(t: ReaderTensor) -> torch.Tensor:
    return torch.from_numpy(
        np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1).copy()
    )


def _load_floats(model: LlamaForCausalLM, tensors: dict[str, ReaderTensor]) -> None:
    """Every norm weight from the file, float32 (the linears are the blocks': they are skipped)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in tensors.items():
        target = hf_name(name)
        if target is None or not target.endswith("norm.weight"):
            continue
        if target not in params:
            raise ModelLoadError(f"{name}: no parameter {target} in the model")
        owner, leaf = target.rsplit(".", 1)
        values = _floats(t).reshape(params[target].shape)
        setattr(model.get_submodule(owner), leaf, nn.Parameter(values, requires_grad=False))
