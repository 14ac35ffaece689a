"""A GGUF checkpoint served with its linear weights kept in their blocks (detected, or ``--quantization gguf``).

Where it sits: ``loader/registry.py`` calls :func:`load_quantized_model` when the engine's quantization
config (``layers/linear/config.py``) says the checkpoint is GGUF. The model is built on the meta
device; its norms (and any float tensor of the file) are materialised in float32; every linear
(q/k/v, o_proj, gate/up, down_proj, the LM head) is read from the .gguf file as raw block rows and
handed to the GGUF linear method (``layers/linear/gguf_blocks.py``), whose resolved matmul its block
calls; the embedding looks its rows up in the blocks and dequantises only those (where the LM head
is tied to it, in the head's packed blocks: one copy of that matrix). The nn.Linear parameters stay on the meta device: they
hold nothing. q/k/v (and gate/up) run as one matmul of their block rows stacked where they
share a format, else as one call each. A decode step runs every layer in one native call
(``model/fused_layers.py``) where each layer's four matmuls are native :class:`QuantLinear` callables (q/k/v
and gate/up of one format each); a file mixing formats within them runs the per-op path.

Tensor parallelism (``shard``): each tensor is read whole and cut to the rank's part by the GGUF
method (:class:`RankCut`, ``GgufMethod.shard``) before its blocks are repacked, exactly where the
float loader cuts it: GGUF blocks run along the input dimension, so q/k/v, gate/up and the
vocabulary rows are whole rows of blocks, and o_proj/down_proj are cut at block boundaries (a
boundary inside a block, e.g. a K-quant's 256 columns over SmolLM2's 384-column rank, is a
:class:`ModelLoadError` naming the tensor and the block size). A
mixture-of-experts file's (llama.cpp's ``qwen3moe``) stacked expert tensors are cut into each
expert's rows of blocks and run grouped (``layers/moe``: ``KernelExperts`` over the same method);
its router is float32, and it runs op by op (on one rank: its experts are not cut for tensor parallelism).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import ReaderTensor
from gguf.quants import dequantize
from torch import nn

from kvfleet.engine.kernels.native.quant_gemm import BLOCK_LAYOUTS, QuantWeight
from kvfleet.engine.layers.linear.config import GgufModel
from kvfleet.engine.layers.linear.gguf_blocks import GgufMethod, QuantEmbedding, Weight
from kvfleet.engine.layers.moe import KernelExperts
from kvfleet.engine.loader.gguf_convert import hf_name, norm_shift, permuted_qk, read_gguf, unpermute_qk
from kvfleet.engine.loader.hf_loader import build_model, load_config
from kvfleet.engine.loader.resident import resident_weight_bytes
from kvfleet.engine.loader.sources import SMOLLM2, gguf_source, smollm2_gguf
from kvfleet.engine.model.config import ModelConfig, ModelLoadError
from kvfleet.engine.model.llama import MLP, DecoderLayer, LlamaForCausalLM
from kvfleet.engine.model.moe import SparseMoeBlock
from kvfleet.engine.model.projections import Matmuls
from kvfleet.engine.model.tp import SliceSpec, slice_for

if TYPE_CHECKING:  # engine/parallel loads weights through this package: named for the type checker only
    from kvfleet.engine.parallel.shard import RankShard

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
    model: str,
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    path: Path | None = None,
    shard: RankShard | None = None,
) -> LlamaForCausalLM:
    """The model of GGUF checkpoint ``model`` (converted to ``folder`` for its config), linears
    quantised; ``path``: its .gguf file where the quantization config found it already; ``shard``:
    this tensor-parallel rank's part (None: the whole model)."""
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
        llama = build_model(config, shard)
    llama.reset_buffers(device)
    permute = permuted_qk(gguf.arch)
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    cut = RankCut(method, config, shard, gguf.arch)
    for i, layer in enumerate(llama.model.layers):
        assert isinstance(layer, DecoderLayer)

        def weight(part: str, i: int = i) -> Weight:
            name = f"blk.{i}.{part}.weight"
            return cut.weight(name, read_weight(tensors[name], heads.get(part) if permute else None))

        biases = [tensors.get(f"blk.{i}.{p}.bias") for p in ("attn_q", "attn_k", "attn_v")]
        qkv_bias = None
        if biases[0] is not None:
            qkv_bias = torch.cat([cut.bias(b.name, _floats(b)) for b in biases if b is not None])
        layer.self_attn.fixed = Matmuls(
            method.load([weight("attn_q"), weight("attn_k"), weight("attn_v")], qkv_bias),
            method.load([weight("attn_output")], None),
        )
        ffn = layer.feed_forward()
        if isinstance(ffn, SparseMoeBlock):  # qwen3moe: the experts in their blocks, the router float32
            if shard is not None and shard.tp_size > 1:
                raise ModelLoadError(
                    f"{path.name}: a GGUF mixture of experts ({gguf.arch}) runs on one rank (yet): its stacked "
                    f"experts are not cut for tensor parallelism; tensor_parallel_size must be 1, got {shard.tp_size}"
                )
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
    # the lookup's and a tied head's (this rank's vocabulary rows under tensor parallelism)
    embed = method.shared(cut.weight("token_embd.weight", read_weight(tensors["token_embd.weight"], None)))
    llama.model.embed_tokens = method.embedding(embed)
    head = tensors.get("output.weight")
    llama.fixed_lm_head = method.load(
        [embed if head is None else cut.weight(head.name, read_weight(head, None))], None
    )
    log.info("quantized weights (gguf %s): %.1f MB resident", path.name, resident_weight_bytes(llama) / 1e6)
    return llama.eval()


class RankCut:
    """This rank's part of each tensor read from the file, as the float loader cuts it
    (``tp.checkpoint_slice`` by the tensor's Hugging Face name): q/k/v, gate/up and the vocabulary
    by output rows (whole rows of blocks), o_proj/down_proj by input columns at block boundaries
    (the activations' blocks stay whole, so each rank's partial sum is the single rank's part)."""

    def __init__(self, method: GgufMethod, config: ModelConfig, shard: RankShard | None, arch: str) -> None:
        self.method, self.config, self.shard, self.arch = method, config, shard, arch

    def _spec(self, name: str, full_shape: tuple[int, ...]) -> SliceSpec | None:
        target = hf_name(name, self.arch)
        if self.shard is None or target is None:
            return None
        spec = slice_for(target, self.shard, self.config)
        if spec is not None and (len(full_shape) <= spec.dim or full_shape[spec.dim] != spec.full):
            raise ModelLoadError(
                f"{name}: shape {full_shape} (out, in), the config needs {spec.full} along axis {spec.dim}"
            )
        return spec

    def weight(self, name: str, w: Weight) -> Weight:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else (w.out_features, w.in_features)
        spec = self._spec(name, shape)
        if spec is None:
            return w
        try:
            return self.method.shard(w, spec.dim, spec.span)
        except ModelLoadError as e:
            assert self.shard is not None
            raise ModelLoadError(
                f"{name} cannot be split over tensor_parallel_size={self.shard.tp_size}: rank "
                f"{self.shard.rank}'s {e}"
            ) from e

    def bias(self, name: str, b: torch.Tensor) -> torch.Tensor:
        spec = self._spec(name, tuple(b.shape))
        return b if spec is None else b[spec.span].contiguous()


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
