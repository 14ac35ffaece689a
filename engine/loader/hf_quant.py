"""Hugging Face checkpoints served with quantised linears: ``--quantization int8``/``fp8``, and
compressed-tensors FP8 / W8A8 int8 checkpoints loaded as they are.

Where it sits: ``loader/registry.py`` calls :func:`load_hf_with` when the engine's quantization config
(``layers/linear/config.py``) names int8 or fp8, or found a compressed-tensors scheme in the
folder's config.json (``layers/linear/checkpoint.py``). The model is built on the meta device; its
norms (and any linear the checkpoint keeps in floats, e.g. an ignored ``lm_head``) are read in the
compute dtype; every linear goes to the ``layers/linear`` method of its format (:func:`method_of`),
whose resolved matmul is handed to its block (``fixed``), as ``loader/gguf_loader.py`` does for GGUF.
What a linear becomes (the config's ``serving_target``):

- ``int8`` (the CPU): per-channel int8 (``kernels/native/int8_gemm.py``), from the checkpoint's
  int8 ``weight``/``weight_scale`` or quantised at load from floats (the embedding too: its rows
  are the channels, looked up and dequantised per step; the LM head, tied or not, as well);
- ``fp8`` (a GPU of compute capability >= 8.9): e4m3 with per-channel scales through
  ``torch._scaled_mm`` (``kernels/fp8_linear.py``), from the checkpoint or quantised at load;
- ``bf16`` (the CPU, a float checkpoint in ``--dtype bfloat16``): bf16 weights in the native bf16
  kernel's panels (``layers/linear/bf16.py``; the embedding in bf16 rows), computed in float32;
- ``float``: a quantised checkpoint where its kernel cannot run (FP8 on a CPU, int8 on a GPU),
  dequantised once to the compute dtype, with a warning.

A decode step runs every layer in one native call (``model/fused_layers.py``) where every layer matmul is
the native int8 kernel's (``int8`` on the CPU) or the native bf16 kernel's; with any other kernel it runs the per-op path.

Tensor parallelism (``shard``): each linear is read whole, quantised where floats are, and cut to the
rank's rows or columns by its method (``LinearMethod.shard``: every row keeps its scale), so
column-parallel outputs are the single rank's bit for bit; a row-parallel matmul quantises its
rank's slice of each token's activations with that slice's own scale, as vLLM's ranks do.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from kvfleet.engine.kernels.fp8_linear import Fp8Weight
from kvfleet.engine.kernels.linear import Linear
from kvfleet.engine.kernels.native.bf16_gemm import Bf16Weight
from kvfleet.engine.kernels.native.int8_gemm import Int8Weight
from kvfleet.engine.layers.linear.base import LinearMethod, get_method
from kvfleet.engine.layers.linear.bf16 import Bf16Method
from kvfleet.engine.layers.linear.config import (
    FP8_ON_CPU,
    QuantizationConfig,
    resolve_quantization,
    serving_target,
)
from kvfleet.engine.layers.linear.fp8 import Fp8Method
from kvfleet.engine.layers.linear.int8 import Int8Embedding, Int8Method
from kvfleet.engine.layers.moe import KernelExperts
from kvfleet.engine.loader.hf_loader import build_model, load_config, weight_files
from kvfleet.engine.loader.resident import resident_weight_bytes
from kvfleet.engine.model.config import ModelConfig, MoeSpec
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from kvfleet.engine.model.moe import SparseMoeBlock
from kvfleet.engine.model.projections import Matmuls
from kvfleet.engine.model.tp import SliceSpec, slice_for

if TYPE_CHECKING:  # engine/parallel loads weights through this package: named for the type checker only
    from kvfleet.engine.parallel.shard import RankShard

log = logging.getLogger(__name__)
Stored = Int8Weight | Fp8Weight | torch.Tensor  # a linear's weight as the checkpoint holds it
Weight = Stored | Bf16Weight  # as its method serves it (bf16: floats laid out in panels at load)
__all__ = [
    "FP8_ON_CPU",
    "Int8Embedding",
    "load_hf_quantized",
    "load_hf_with",
    "resident_weight_bytes",
    "serving_target",
]


class Tensors:
    """The checkpoint's tensors by name, each file opened once."""

    def __init__(self, folder: Path) -> None:
        self.files = weight_files(folder)
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ModelLoadError(f"{sorted({str(p) for p in self.files.values()})}: no tensor {name!r}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        tensor: torch.Tensor = self._open[path].get_tensor(name)  # type: ignore[attr-defined]
        return tensor


def read_linear(tensors: Tensors, name: str) -> Stored:
    """``name.weight`` as stored: int8 or e4m3 with its ``weight_scale`` (per channel or per tensor), or floats."""
    weight = tensors[f"{name}.weight"]
    if weight.dtype not in (torch.int8, torch.float8_e4m3fn):
        return weight
    scale = tensors[f"{name}.weight_scale"].float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(weight.shape[0])
    scale = scale.contiguous()
    if weight.dtype == torch.int8:
        return Int8Weight(weight.contiguous(), scale)
    return Fp8Weight(weight.contiguous(), scale)


def convert(w: Stored, quant: QuantizationConfig, dtype: torch.dtype, device: torch.device) -> Weight:
    """``w`` as ``quant``'s method serves it: floats quantised only for a flag on a float checkpoint."""
    method = quant.linear_method(dtype)
    if isinstance(w, torch.Tensor):
        if quant.quantizes_floats and isinstance(method, Int8Method):
            return method.quantize(w)
        if quant.quantizes_floats and isinstance(method, Fp8Method):
            return method.quantize(w.to(device))
        if quant.quantizes_floats and isinstance(method, Bf16Method):
            return method.quantize(w)
        return w.to(dtype=dtype, device=device)
    if quant.method == "float":
        return (
            w.dequantised().to(dtype=dtype, device=device)
            if isinstance(w, Int8Weight)
            else w.dequantised(dtype).to(device)
        )
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.qweight.to(device), w.scale.to(device))
    return w


def method_of(weights: list[Weight], dtype: torch.dtype) -> LinearMethod:
    """The linear method of one matmul's weights, by how they are held (an ignored ``lm_head`` stays float)."""
    kinds = {_format(w) for w in weights}
    if len(kinds) != 1:
        raise ModelLoadError("one matmul's linears are stored in different formats")
    return get_method(kinds.pop(), dtype)


def _format(w: Weight) -> str:
    if isinstance(w, Bf16Weight):
        return "bf16"
    return "int8" if isinstance(w, Int8Weight) else "fp8" if isinstance(w, Fp8Weight) else "float"


def linear_of(weights: list[Weight], bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
    """The linears ``weights`` (outputs side by side, one format) as one resolved callable."""
    return method_of(weights, dtype).load(weights, bias)


def _shape(w: Weight) -> tuple[int, ...]:
    if isinstance(w, Bf16Weight):
        return (w.out_features, w.in_features)
    return tuple(w.shape if isinstance(w, torch.Tensor) else w.qweight.shape)


class _Plan:
    """One load's choices: the tensors, what linears become, the compute dtype and device, and this
    rank's shard (None: the whole model)."""

    def __init__(
        self,
        tensors: Tensors,
        quant: QuantizationConfig,
        dtype: torch.dtype,
        device: torch.device,
        shard: RankShard | None = None,
    ) -> None:
        self.tensors, self.quant, self.dtype, self.device = tensors, quant, dtype, device
        self.shard = shard

    def slice_of(self, name: str, config: ModelConfig) -> SliceSpec | None:
        """This rank's slice of checkpoint tensor ``name`` (``tp.checkpoint_slice``); None: all of it."""
        return None if self.shard is None else slice_for(name, self.shard, config)

    def weight(self, name: str, config: ModelConfig) -> Weight:
        """``name.weight`` as its method serves it, then this rank's rows or columns of it (quantised
        whole first, so each row's scale is the single rank's)."""
        w = convert(read_linear(self.tensors, name), self.quant, self.dtype, self.device)
        spec = self.slice_of(f"{name}.weight", config)
        if spec is None:
            return w
        if _shape(w)[spec.dim] != spec.full:
            raise ModelLoadError(
                f"{name}.weight has shape {_shape(w)}, the config needs {spec.full} on axis {spec.dim}"
            )
        return method_of([w], self.dtype).shard(w, spec.dim, spec.span)

    def bias(self, names: list[str], config: ModelConfig) -> torch.Tensor | None:
        found = [self.tensors[f"{n}.bias"] for n in names if f"{n}.bias" in self.tensors]
        if not found:
            return None
        if len(found) != len(names):
            raise ModelLoadError(f"{names}: some of one matmul's linears have a bias, some not")
        specs = [self.slice_of(f"{n}.bias", config) for n in names]
        found = [b if s is None else b[s.span] for b, s in zip(found, specs, strict=True)]
        return torch.cat(found).to(
            dtype=torch.float32 if self.quant.method == "int8" else self.dtype, device=self.device
        )

    def experts(self, prefix: str, spec: MoeSpec, config: ModelConfig) -> KernelExperts:
        """Every expert's gate/up and down matmuls of the sparse block ``prefix``, this rank's columns."""
        gate, up, down = spec.linear_names
        names = [f"{prefix}.experts.{e}" for e in range(spec.num_experts)]
        return KernelExperts(
            tuple(
                linear_of(
                    [self.weight(f"{n}.{gate}", config), self.weight(f"{n}.{up}", config)], None, self.dtype
                )
                for n in names
            ),
            tuple(linear_of([self.weight(f"{n}.{down}", config)], None, self.dtype) for n in names),
        )

    def matmuls(self, prefix: str, inputs: tuple[str, ...], output: str, config: ModelConfig) -> Matmuls:
        names, out = [f"{prefix}.{n}" for n in inputs], f"{prefix}.{output}"
        # row-parallel: the output linear's bias is added once, by the rank that holds it, before the sum
        out_bias = (
            self.bias([out], config) if self.shard is None or self.shard.holds_row_parallel_bias else None
        )
        return Matmuls(
            linear_of([self.weight(n, config) for n in names], self.bias(names, config), self.dtype),
            linear_of([self.weight(out, config)], out_bias, self.dtype),
        )


def load_hf_quantized(
    flag: str | None, folder: Path, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The model of Hugging Face ``folder`` with its linears quantised (``flag``, or as the checkpoint is)."""
    return load_hf_with(resolve_quantization(flag, folder, device, dtype), folder, dtype, device)


def load_hf_with(
    quant: QuantizationConfig,
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    shard: RankShard | None = None,
) -> LlamaForCausalLM:
    """The model of Hugging Face ``folder`` with its linears served as ``quant`` resolved them;
    ``shard``: this tensor-parallel rank's part (each linear's method cuts its rows or columns)."""
    plan = _Plan(Tensors(folder), quant, dtype, device, shard)
    config = load_config(folder)
    with torch.device("meta"):
        llama = build_model(config, shard)
    if config.moe is not None and config.moe.biases:  # its sinks and biased experts are float weights
        raise ModelLoadError(
            f"{folder}: {config.architecture} is not served quantized ({quant.source}); "
            "serve it in floats (its MXFP4 experts are dequantized at load)"
        )
    llama.reset_buffers(device)
    for i, layer in enumerate(llama.model.layers):
        assert isinstance(layer, DecoderLayer)
        prefix = f"model.layers.{i}"
        layer.self_attn.fixed = plan.matmuls(
            f"{prefix}.self_attn", Attention.INPUTS, Attention.OUTPUT, config
        )
        ffn = layer.feed_forward()
        if isinstance(ffn, SparseMoeBlock):  # the router stays in the compute dtype
            assert config.moe is not None
            block = f"{prefix}.{config.moe.block_name}"
            ffn.fixed = plan.experts(block, config.moe, config)
            router = plan.tensors[f"{block}.gate.weight"].to(dtype=dtype, device=device)
            ffn.gate.weight = nn.Parameter(router, requires_grad=False)
        else:
            assert isinstance(ffn, MLP)
            ffn.fixed = plan.matmuls(f"{prefix}.mlp", MLP.INPUTS, MLP.OUTPUT, config)
    _load_norms(llama, plan)
    _load_embedding_and_head(llama, plan, config)
    log.info(
        "quantized weights (%s, %s): %.1f MB resident",
        quant.source,
        quant.method,
        resident_weight_bytes(llama) / 1e6,
    )
    return llama.eval()


def _load_norms(model: LlamaForCausalLM, plan: _Plan) -> None:
    for name, param in list(model.named_parameters()):
        if not name.endswith("norm.weight"):
            continue
        values = plan.tensors[name].to(dtype=plan.dtype, device=plan.device)
        if tuple(values.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{name} has shape {tuple(values.shape)}, the config needs {tuple(param.shape)}"
            )
        owner, leaf = name.rsplit(".", 1)
        setattr(model.get_submodule(owner), leaf, nn.Parameter(values, requires_grad=False))


def _load_embedding_and_head(model: LlamaForCausalLM, plan: _Plan, config: ModelConfig) -> None:
    """The embedding (int8 rows where floats are quantised to int8, else floats) and the LM head
    (this rank's vocabulary rows of each under tensor parallelism)."""
    embed = plan.weight("model.embed_tokens", config)
    model.model.embed_tokens = method_of([embed], plan.dtype).embedding(embed)
    head = embed if config.tie_word_embeddings else plan.weight("lm_head", config)
    model.fixed_lm_head = linear_of([head], None, plan.dtype)
