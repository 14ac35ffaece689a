"""How many bytes a loaded model's weights hold, however they are stored: what the loaders log at start.

Where it sits: the quantised loaders (``loader/gguf_loader.py`` for GGUF blocks,
``loader/hf_quant.py`` for int8/fp8) report :func:`resident_weight_bytes` once loaded, and the
tests and ``bench/kernels/quant_speed.py`` compare it with float32. A weight may live in the
model's parameters, in a quantised embedding, or in the matmuls the blocks resolved: every tensor
reachable from those is counted once, by its storage (``layers/linear/bytes.py``).
"""

from __future__ import annotations

from kvfleet.engine.layers.linear.bytes import storage_bytes
from kvfleet.engine.model.llama import DecoderLayer, LlamaForCausalLM


def resident_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every distinct storage the weights use (a storage shared by two views counts once)."""
    held: list[object] = [*model.parameters(), model.model.embed_tokens, model.lm_head_matmul()]
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        for block in (layer.self_attn, layer.feed_forward()):
            held.extend(block.matmuls())  # type: ignore[operator]
    return storage_bytes(held)
