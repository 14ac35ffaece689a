"""Hugging Face checkpoints served with quantised linears: ``--quantization int8``/``fp8``, and
compressed-tensors FP8 / W8A8 int8 checkpoints loaded as they are.

Where it sits: ``ModelRunner`` calls :func:`load_hf_quantized` in place of ``loader.load_model``
when ``EngineConfig.quantization`` is int8 or fp8, or the folder's config.json carries a
compressed-tensors scheme (``compressed_tensors.py``). The model is built on the meta device; its
norms (and any linear the checkpoint keeps in floats, e.g. an ignored ``lm_head``) are read in the
compute dtype; every linear becomes a resolved callable handed to its block (``fixed``), as
``quant_loader.py`` does for GGUF. What a linear becomes (:func:`serving_target`):

- ``int8`` (the CPU): per-channel int8 (``kernels/native/int8_gemm.py``), from the checkpoint's
  int8 ``weight``/``weight_scale`` or quantised at load from floats (the embedding too: its rows
  are the channels, looked up and dequantised per step; the LM head, tied or not, as well);
- ``fp8`` (a GPU of compute capability >= 8.9): e4m3 with per-channel scales through
  ``torch._scaled_mm`` (``kernels/fp8_linear.py``), from the checkpoint or quantised at load;
- ``float``: a quantised checkpoint where its kernel cannot run (FP8 on a CPU, int8 on a GPU),
  dequantised once to the compute dtype, with a warning.

A decode step runs every layer in one native call (``fused_decode.py``) where every layer matmul is
the native int8 kernel's (``int8`` on the CPU); with any other kernel it runs the per-op path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import nn

from kvfleet.engine.kernels.fp8_linear import (
    Fp8Weight,
    concat_fp8,
    fp8_supported,
    quantize_fp8_per_channel,
    resolve_fp8_linear,
)
from kvfleet.engine.kernels.int8_linear import concat_int8, resolve_int8_linear
from kvfleet.engine.kernels.linear import Linear, resolve_linear
from kvfleet.engine.kernels.native.int8_gemm import Int8Weight, quantize_per_channel
from kvfleet.engine.model.compressed_tensors import Scheme, checkpoint_quantization
from kvfleet.engine.model.errors import ModelLoadError
from kvfleet.engine.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from kvfleet.engine.model.loader import load_config, weight_files
from kvfleet.engine.model.projections import Matmuls
from kvfleet.engine.model.resident import resident_weight_bytes

log = logging.getLogger(__name__)
Weight = Int8Weight | Fp8Weight | torch.Tensor
Target = Literal["int8", "fp8", "float"]
FP8_ON_CPU = (
    "--quantization fp8 needs a GPU of compute capability >= 8.9 (torch._scaled_mm on e4m3); "
    "on the CPU use --quantization int8 (any Hugging Face checkpoint) or gguf (a .gguf model)"
)


def serving_target(flag: str | None, scheme: Scheme | None, device: torch.device) -> Target:
    """What the linears become for ``--quantization flag``, the checkpoint's ``scheme``, on ``device``."""
    if flag is not None and scheme is not None and flag != scheme:
        raise ModelLoadError(f"--quantization {flag} asked of a compressed-tensors {scheme} checkpoint")
    want = flag or scheme
    if want == "int8":
        if device.type == "cpu":
            return "int8"
        if scheme is None:
            raise ModelLoadError(
                "--quantization int8 runs on the CPU kernels; on a GPU use --quantization fp8"
            )
        log.warning("int8 checkpoint on %s: no int8 GPU kernel, weights dequantised at load", device)
        return "float"
    if fp8_supported(device):
        return "fp8"
    if scheme is None:
        raise ModelLoadError(FP8_ON_CPU)
    log.warning(
        "fp8 checkpoint on %s (fp8 matmuls need a GPU of compute capability >= 8.9): dequantised at load",
        device,
    )
    return "float"


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


def read_linear(tensors: Tensors, name: str) -> Weight:
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


def convert(
    w: Weight, target: Target, quantize_floats: bool, dtype: torch.dtype, device: torch.device
) -> Weight:
    """``w`` as ``target`` serves it: floats quantised only for a flag on a float checkpoint."""
    if isinstance(w, torch.Tensor):
        if quantize_floats and target == "int8":
            return quantize_per_channel(w)
        if quantize_floats and target == "fp8":
            return quantize_fp8_per_channel(w.to(device))
        return w.to(dtype=dtype, device=device)
    if target == "float":
        return (
            w.dequantised().to(dtype=dtype, device=device)
            if isinstance(w, Int8Weight)
            else w.dequantised(dtype).to(device)
        )
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.qweight.to(device), w.scale.to(device))
    return w


def linear_of(weights: list[Weight], bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
    """The linears ``weights`` (outputs side by side, one format) as one resolved callable."""
    if all(isinstance(w, Int8Weight) for w in weights):
        return resolve_int8_linear(concat_int8([w for w in weights if isinstance(w, Int8Weight)]), bias)
    if all(isinstance(w, Fp8Weight) for w in weights):
        return resolve_fp8_linear(concat_fp8([w for w in weights if isinstance(w, Fp8Weight)]), bias, dtype)
    floats = [w for w in weights if isinstance(w, torch.Tensor)]
    if len(floats) != len(weights):
        raise ModelLoadError("one matmul's linears are stored in different formats")
    return resolve_linear(torch.cat(floats).contiguous(), bias)


class Int8Embedding(nn.Embedding):
    """The token embedding kept in int8 rows (one scale each): only the rows a step reads are dequantised."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype) -> None:
        n, k = weight.out_features, weight.in_features
        super().__init__(n, k, _weight=torch.empty(n, k, device="meta"))
        self.int8 = weight
        self.out_dtype = dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ids = input.cpu()
        rows = self.int8.qweight[ids].float() * self.int8.scale[ids].unsqueeze(-1)
        return rows.to(dtype=self.out_dtype, device=input.device)


class _Plan:
    """One load's choices: the tensors, what linears become, the compute dtype and device."""

    def __init__(
        self,
        tensors: Tensors,
        target: Target,
        quantize_floats: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.tensors, self.target, self.quantize_floats = tensors, target, quantize_floats
        self.dtype, self.device = dtype, device

    def weight(self, name: str) -> Weight:
        return convert(
            read_linear(self.tensors, name), self.target, self.quantize_floats, self.dtype, self.device
        )

    def bias(self, names: list[str]) -> torch.Tensor | None:
        found = [self.tensors[f"{n}.bias"] for n in names if f"{n}.bias" in self.tensors]
        if not found:
            return None
        if len(found) != len(names):
            raise ModelLoadError(f"{names}: some of one matmul's linears have a bias, some not")
        return torch.cat(found).to(
            dtype=torch.float32 if self.target == "int8" else self.dtype, device=self.device
        )

    def matmuls(self, prefix: str, inputs: tuple[str, ...], output: str) -> Matmuls:
        names = [f"{prefix}.{n}" for n in inputs]
        return Matmuls(
            linear_of([self.weight(n) for n in names], self.bias(names), self.dtype),
            linear_of([self.weight(f"{prefix}.{output}")], self.bias([f"{prefix}.{output}"]), self.dtype),
        )


def load_hf_quantized(
    flag: str | None, folder: Path, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The model of Hugging Face ``folder`` with its linears quantised (``flag``, or as the checkpoint is)."""
    scheme = checkpoint_quantization(folder)
    target = serving_target(flag, scheme, device)
    plan = _Plan(Tensors(folder), target, scheme is None, dtype, device)
    config = load_config(folder)
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    llama.model.rotary_emb.reset_buffers(device)
    for i, layer in enumerate(llama.model.layers):
        assert isinstance(layer, DecoderLayer)
        prefix = f"model.layers.{i}"
        layer.self_attn.fixed = plan.matmuls(f"{prefix}.self_attn", Attention.INPUTS, Attention.OUTPUT)
        layer.mlp.fixed = plan.matmuls(f"{prefix}.mlp", MLP.INPUTS, MLP.OUTPUT)
    _load_norms(llama, plan)
    _load_embedding_and_head(llama, plan, config.tie_word_embeddings)
    log.info(
        "quantized weights (%s, %s): %.1f MB resident",
        flag or f"compressed-tensors {scheme}",
        target,
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


def _load_embedding_and_head(model: LlamaForCausalLM, plan: _Plan, tied: bool) -> None:
    """The embedding (int8 rows where floats are quantised to int8, else floats) and the LM head."""
    embed = plan.weight("model.embed_tokens")
    if isinstance(embed, Int8Weight):
        model.model.embed_tokens = Int8Embedding(embed, plan.dtype)
    else:
        floats = embed.dequantised(plan.dtype) if isinstance(embed, Fp8Weight) else embed
        model.model.embed_tokens = nn.Embedding.from_pretrained(floats.to(plan.dtype), freeze=True)
    head = embed if tied else plan.weight("lm_head")
    model.fixed_lm_head = linear_of([head], None, plan.dtype)
