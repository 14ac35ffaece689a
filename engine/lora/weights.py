"""A LoRA adapter's weights, read from ``adapter_model.safetensors`` into CPU memory and checked.

Where it sits: :class:`~kvfleet.engine.lora.manager.LoraManager` calls :func:`load_weights`
when an adapter is registered (so a corrupt file is refused at once, not at its first
request) and again when one evicted from its CPU cache is asked for. Each matrix must fit
the model: ``lora_A`` is (r, in), ``lora_B`` is (out, r) with the projection's in/out sizes.
The scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) is folded into B here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvfleet.engine.lora.config import PROJECTION_AXES, WEIGHTS_FILE, AdapterConfig, LoraError

if TYPE_CHECKING:  # the model imports this package's LoRA context: named for the type checker only
    from kvfleet.engine.model.config import ModelConfig


_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection an adapter may target."""
    d = config.head_dim
    size = {"hidden": config.hidden_size, "q": config.num_heads * d, "kv": config.num_kv_heads * d}
    size["inter"] = config.intermediate_size
    return {module: (size[a], size[b]) for module, (a, b) in PROJECTION_AXES.items()}


@dataclass(frozen=True)
class LoraWeights:
    """Per (layer, module): A (r, in) and B transposed and scaled, (r, out), float32 on the CPU."""

    name: str
    path: str
    config: AdapterConfig
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


def load_weights(name: str, path: str, config: AdapterConfig, model: ModelConfig) -> LoraWeights:
    """Read and check the adapter's matrices; a :class:`LoraError` (field ``lora_path``) says what is wrong."""
    file = Path(path) / WEIGHTS_FILE
    try:
        tensors = load_file(str(file))
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        raise LoraError("lora_path", f"{file} is not a readable safetensors file: {exc}") from None
    shapes = module_shapes(model)
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoraError(
                "lora_path", f"{file}: tensor {key!r} is not a LoRA matrix of a layer's projection"
            )
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in shapes:
            raise LoraError("lora_path", f"{file}: {key!r} targets {module}, which this model does not have")
        if layer >= model.num_layers:
            raise LoraError(
                "lora_path", f"{file}: {key!r} is for layer {layer}; the model has {model.num_layers}"
            )
        fan_in, fan_out = shapes[module]
        want = (config.rank, fan_in) if which == "A" else (fan_out, config.rank)
        if tuple(tensor.shape) != want:
            raise LoraError(
                "lora_path",
                f"{file}: {key!r} has shape {tuple(tensor.shape)}, this model needs {want} "
                f"(r={config.rank}; is the adapter for another base model?)",
            )
        if which == "A":
            a[(layer, module)] = tensor.float().contiguous()
        else:
            b[(layer, module)] = (tensor.float().t() * config.scaling).contiguous()
    if set(a) != set(b):
        missing = sorted(set(a) ^ set(b))[0]
        raise LoraError("lora_path", f"{file}: layer {missing[0]} {missing[1]} lacks its lora_A or lora_B")
    if not a:
        raise LoraError("lora_path", f"{file} holds no LoRA matrices")
    return LoraWeights(name, path, config, a, b)
