"""Gemma 3 (text) in plain torch: the shared decoder's attention and MLP with Gemma's differences.

Where it sits: the architecture registry (``families/gemma3.py``) names :class:`Gemma3ForCausalLM`
for ``Gemma3ForCausalLM`` checkpoints; the loaders build it as they build the shared decoder
(``llama.py``), whose packing, LM head and tensor-parallel slicing it inherits. What differs, as
transformers' ``modeling_gemma3`` computes it: RMSNorm scales by ``1 + w`` (float32, cast after);
q/k are normed per head with it before the rotary; a norm after attention and around the MLP
(pre and post); GeGLU with tanh GELU; embeddings times sqrt(hidden); attention scaled by
1/sqrt(query_pre_attn_scalar); the sliding layers rotate with their own (local) base. Every step
runs op by op: the native decode call does not hold these layers.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.engine.lora.context import DOWN_PROJ, GATE_UP, LoraContext
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
    RotaryEmbedding,
    Step,
)
from kvfleet.engine.model.tp import summed_over_ranks

if TYPE_CHECKING:  # engine/parallel imports the model: named for the type checker only
    from kvfleet.engine.parallel.group import TPComm
    from kvfleet.engine.parallel.shard import RankShard


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma3RMSNorm: float32 statistics, times (1 + w) in float32, then cast."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps)
        self.weight = nn.Parameter(torch.zeros(size))

    def add_forward(
        self, x: torch.Tensor | None, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = residual if x is None else x + residual
        return self(hidden), hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, layer: int, shard: RankShard | None = None) -> None:
        super().__init__(config, layer, shard)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)


class GemmaMLP(MLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def forward(
        self, x: torch.Tensor, lora: LoraContext | None = None, comm: TPComm | None = None
    ) -> torch.Tensor:
        matmuls = self.matmuls()
        gate_up = matmuls.inputs(x)
        if lora is not None:
            lora.add(x, gate_up, self.layer, GATE_UP)
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.gelu(gate, approximate="tanh") * up
        down = matmuls.output(h)
        if lora is not None:
            lora.add(h, down, self.layer, DOWN_PROJ)
        return summed_over_ranks(down, comm)


class Gemma3DecoderLayer(DecoderLayer):
    """Sandwich norms: stream += post_attn(attn(input(stream))); stream += post_ff(mlp(pre_ff(stream)))."""

    def __init__(self, config: ModelConfig, layer: int, shard: RankShard | None = None) -> None:
        nn.Module.__init__(self)  # not DecoderLayer's: its norms and MLP are Llama's
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(config, layer, shard)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(config, layer, shard)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def enter(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else x + residual
        return self.input_layernorm(stream), stream

    def after_attention(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual + self.post_attention_layernorm(h)
        return self.pre_feedforward_layernorm(stream), stream

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(out)


class Gemma3Model(LlamaModel):
    def __init__(self, config: ModelConfig, shard: RankShard | None = None) -> None:
        super().__init__(config, shard, Gemma3DecoderLayer, GemmaRMSNorm)
        local = dataclasses.replace(config, rope_theta=config.local_rope_theta or 10000.0, rope_scaling=None)
        self.local_rotary_emb = RotaryEmbedding(local)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """``forward`` as the shared decoder's, per-op: float32 logits at the rows that sample."""

    def decoder(self, config: ModelConfig, shard: RankShard | None) -> LlamaModel:
        return Gemma3Model(config, shard)

    def no_native_layer(self) -> str | None:
        return "Gemma 3's layers (sandwich norms, GeGLU, two rotary bases) are not part of the native decode call"

    def reset_buffers(self, device: torch.device) -> None:
        super().reset_buffers(device)
        assert isinstance(self.model, Gemma3Model)
        self.model.local_rotary_emb.reset_buffers(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # as transformers rounds it

    def layer_steps(self, step: Step, positions: torch.Tensor, dtype: torch.dtype) -> list[Step]:
        """The global layers take the shared ``Step``; the sliding ones the local rotary base's."""
        model = self.model
        assert isinstance(model, Gemma3Model)
        local = step._replace(rope=model.local_rotary_emb(positions, step.meta, dtype))
        steps = []
        for layer in model.layers:
            assert isinstance(layer, Gemma3DecoderLayer)
            steps.append(step if layer.self_attn.sliding_window is None else local)
        return steps
