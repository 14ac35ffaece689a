"""How many bytes a loaded model's weights hold, however they are stored: what the loaders log at start.

Where it sits: the quantised loaders (``model/quant_loader.py`` for GGUF blocks,
``model/hf_quant_loader.py`` for int8/fp8) report :func:`resident_weight_bytes` once loaded, and the
tests and ``bench/kernels/quant_speed.py`` compare it with float32. A weight may live in the
model's parameters, in a quantised embedding, or in the matmuls the blocks resolved (packed
blocks, int8 rows and their scales, parts of a concatenated matmul): every tensor reachable from
those is counted once, by its storage.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvfleet.engine.model.llama import DecoderLayer, LlamaForCausalLM

_DEPTH = 4  # a matmul → its parts → a weight record → its tensors


def resident_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every distinct storage the weights use (a storage shared by two views counts once)."""
    seen: dict[int, int] = {}
    held: list[object] = [*model.parameters(), model.model.embed_tokens, model.lm_head_matmul()]
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        for block in (layer.self_attn, layer.mlp):
            held.extend(block.matmuls())
    for tensor in (t for obj in held for t in _tensors(obj, _DEPTH)):
        if tensor.is_meta:
            continue
        try:
            storage = tensor.untyped_storage()
        except NotImplementedError:  # opaque (a GEMM library's packed copy): its size is not exposed
            continue
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _tensors(obj: object, depth: int) -> Iterator[torch.Tensor]:
    """The tensors ``obj`` is or holds, through containers and attributes ``depth`` levels down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
        yield from (t for v in vars(obj).values() if not isinstance(v, dict) for t in _tensors(v, depth - 1))
    elif depth > 0 and isinstance(obj, list | tuple):
        yield from (t for item in obj for t in _tensors(item, depth - 1))
    elif depth > 0:
        yield from (t for v in _attributes(obj) for t in _tensors(v, depth - 1))


def _attributes(obj: object) -> list[object]:
    """The values of ``obj``'s instance attributes: its ``__dict__`` and every ``__slots__`` entry."""
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                values.append(getattr(obj, name))
    return values
