"""gpt-oss in plain torch: the shared decoder's attention with sinks and a sparse block of biased experts.

Where it sits: the architecture registry (``families/gpt_oss.py``) names :class:`GptOssForCausalLM`
for ``GptOssForCausalLM`` checkpoints; the loaders build it as the shared decoder (``llama.py``),
whose norms, rotary (YaRN), q/k/v/o biases, windows and LM head it keeps. What differs, as
transformers' ``modeling_gpt_oss`` computes it: each attention layer holds ``sinks``, a logit per
head in its softmax (every attention backend takes them through ``LayerKV.sinks``); each
feed-forward is :class:`GptOssMoeBlock`: a router with a bias whose top-k logits are
softmaxed (``topk_softmax``), and experts stacked as the checkpoint stores them,
``gate_up_proj`` (E, H, 2I) with gate and up columns interleaved and ``down_proj`` (E, I, H), each
with a bias, through the clamped SwiGLU (``layers/moe/grouped.py``). The stacked experts are the
checkpoint's own tensors, seen transposed: no copy. Every step runs op by op (the native decode
call holds neither sinks nor experts: ``no_native_layer`` says so).

Tensor parallelism: each rank holds its heads' sinks and its share of every expert's intermediate
columns (interleaved gate/up pairs stay together), the router whole; the down bias is added on one
rank only, and the block's output is summed over the ranks with one all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.engine.layers.moe import Activation, StackedExperts, get_router, grouped_moe
from kvfleet.engine.lora.context import LoraContext
from kvfleet.engine.model.config import ModelConfig, MoeSpec
from kvfleet.engine.model.llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from kvfleet.engine.model.moe import expert_columns
from kvfleet.engine.model.projections import store_for_matmul
from kvfleet.engine.model.tp import summed_over_ranks

if TYPE_CHECKING:  # engine/parallel imports the model: named for the type checker only
    from kvfleet.engine.parallel.group import TPComm
    from kvfleet.engine.parallel.shard import RankShard


class GptOssAttention(Attention):
    """The shared attention with ``sinks`` (this rank's heads), handed to the backend per layer."""

    def __init__(self, config: ModelConfig, layer: int, shard: RankShard | None = None) -> None:
        super().__init__(config, layer, shard)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(experts), requires_grad=False)


class GptOssExperts(nn.Module):
    """Every expert's weights stacked, under the checkpoint's names and layout."""

    def __init__(self, hidden: int, inter: int, experts: int, down_bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * inter), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * inter), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(experts, inter, hidden), requires_grad=False)
        self.down_proj_bias = (
            nn.Parameter(torch.zeros(experts, hidden), requires_grad=False) if down_bias else None
        )

    def stacked(self) -> StackedExperts:
        """(E, 2I, H) and (E, H, I) views of the checkpoint's (E, H, 2I) and (E, I, H) tensors."""
        return StackedExperts(
            self.gate_up_proj.transpose(1, 2),
            self.down_proj.transpose(1, 2),
            self.gate_up_proj_bias,
            self.down_proj_bias,
        )


class GptOssMoeBlock(nn.Module):
    """``router`` then ``experts``; forward as ``llama.MLP``'s (rows in, rows out, summed over ranks)."""

    def __init__(self, config: ModelConfig, spec: MoeSpec, shard: RankShard | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.route = get_router(spec.router)
        self.activation = Activation(spec.activation, spec.swiglu_alpha, spec.swiglu_limit)
        self.router = GptOssRouter(config.hidden_size, spec.num_experts)
        down_bias = shard is None or shard.holds_row_parallel_bias
        inter = expert_columns(spec, shard)
        self.experts = GptOssExperts(config.hidden_size, inter, spec.num_experts, down_bias)

    def matmuls(self) -> tuple[object, ...]:
        """What the block's weights are held in (``loader/resident.py`` counts their bytes)."""
        return (self.router.weight, self.experts.gate_up_proj, self.experts.down_proj)

    def forward(
        self, x: torch.Tensor, lora: LoraContext | None = None, comm: TPComm | None = None
    ) -> torch.Tensor:
        if lora is not None:
            raise ValueError("LoRA adapters on a gpt-oss model are not supported")
        logits = F.linear(x, self.router.weight, self.router.bias)
        routing = self.route(logits, self.spec.top_k, self.spec.renormalize)
        out = grouped_moe(x, routing, self.experts.stacked(), self.activation)
        return summed_over_ranks(out, comm)


class GptOssDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int, shard: RankShard | None = None) -> None:
        nn.Module.__init__(self)  # not DecoderLayer's: its attention and MLP are Llama's
        assert config.moe is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GptOssAttention(config, layer, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.add_module(
            "mlp", GptOssMoeBlock(config, config.moe, shard)
        )  # not llama.MLP: no ``self.mlp`` type

    def feed_forward(self) -> nn.Module:
        return self.get_submodule("mlp")


class GptOssForCausalLM(LlamaForCausalLM):
    """``forward`` as the shared decoder's, per-op: float32 logits at the rows that sample."""

    LAYER = GptOssDecoderLayer

    def pack_layer(self, layer: DecoderLayer) -> None:
        """The attention's linears only: the experts run unpacked."""
        store_for_matmul(layer.self_attn.output_linear())
        layer.self_attn.pack()

    def prepack(self, kind: str = "auto") -> str | None:
        """Not for gpt-oss: its experts run unpacked (None: none applied)."""
        return None
