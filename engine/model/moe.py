"""The mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama-family model with sparse blocks.

Where it sits: the loaders build :class:`MoeForCausalLM` for the families that name it in the
architecture registry (``model/families/moe.py``, whose config hook sets the
:class:`~kvfleet.engine.model.config.MoeSpec`); everything but the feed-forward is
``llama.py``'s (Qwen3-MoE's per-head q/k RMSNorm included, ``ModelConfig.qk_norm``). Each sparse
layer's block routes its rows (``layers/moe/router.py``) and runs the experts grouped
(``layers/moe/grouped.py``); layers the config keeps dense (Qwen3-MoE's ``mlp_only_layers``) keep
``llama.MLP``. Submodules carry the checkpoint's names (``mlp.experts.3.gate_proj``,
``block_sparse_moe.experts.3.w1``), so the float loader copies them as any other weight; ``pack``
then stacks each block's experts (the linears become views, weights held once).

Tensor parallelism: every expert holds its contiguous share of the expert intermediate columns
(gate/up rows, down columns; ``tp.checkpoint_slice``), the router is whole on every rank, and
the block's output is summed over the ranks with one all-reduce. The one-call native decode and
GEMM-library prepacking do not cover the sparse block: every step runs op by op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.engine.layers.moe import Experts, KernelExperts, StackedExperts, get_router, grouped_moe
from kvfleet.engine.lora.context import LoraContext
from kvfleet.engine.model.config import ModelConfig, MoeSpec
from kvfleet.engine.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from kvfleet.engine.model.projections import store_for_matmul
from kvfleet.engine.model.tp import split_span, summed_over_ranks

if TYPE_CHECKING:  # engine/parallel imports the model: named for the type checker only
    from kvfleet.engine.parallel.group import TPComm
    from kvfleet.engine.parallel.shard import RankShard


class ExpertMLP(nn.Module):
    """One expert's SwiGLU linears under the checkpoint's names (gate, up, down)."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        gate, up, down = names
        self.names = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False))
        setattr(self, up, nn.Linear(hidden, inter, bias=False))
        setattr(self, down, nn.Linear(inter, hidden, bias=False))

    def linear(self, which: int) -> nn.Linear:
        lin = getattr(self, self.names[which])
        assert isinstance(lin, nn.Linear)
        return lin


def expert_columns(spec: MoeSpec, shard: RankShard | None) -> int:
    """The expert intermediate columns this rank holds (all of them at tp=1)."""
    if shard is None:
        return spec.expert_intermediate_size
    span = split_span(spec.expert_intermediate_size, shard.tp_size, shard.rank)
    return span.stop - span.start


class SparseMoeBlock(nn.Module):
    """A router (``gate``, (E, H)) and ``num_experts`` SwiGLU experts; forward as ``MLP``'s."""

    def __init__(self, config: ModelConfig, spec: MoeSpec, shard: RankShard | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.route = get_router("softmax_topk")
        self.gate = nn.Linear(config.hidden_size, spec.num_experts, bias=False)
        inter = expert_columns(spec, shard)
        self.experts = nn.ModuleList(
            ExpertMLP(config.hidden_size, inter, spec.linear_names) for _ in range(spec.num_experts)
        )
        self.stacked: StackedExperts | None = None  # by pack()
        self.fixed: Experts | None = None  # a quantized loader's experts: win over the floats

    def pack(self) -> None:
        """Stack the experts' weights: (E, 2I, H) gate rows then up rows, and (E, H, I)."""
        experts = [e for e in self.experts if isinstance(e, ExpertMLP)]
        w13 = torch.stack([torch.cat([e.linear(0).weight, e.linear(1).weight]) for e in experts])
        w2 = torch.stack([e.linear(2).weight for e in experts])
        inter = w2.shape[2]
        for i, e in enumerate(experts):
            for which, view in enumerate((w13[i, :inter], w13[i, inter:], w2[i])):
                e.linear(which).weight = nn.Parameter(view, requires_grad=False)
        self.stacked = StackedExperts(w13, w2)

    def experts_now(self) -> Experts:
        if self.fixed is not None:
            return self.fixed
        if self.stacked is None:
            self.pack()
        assert self.stacked is not None
        return self.stacked

    def matmuls(self) -> tuple[object, ...]:
        """What the block's weights are held in (``loader/resident.py`` counts their bytes)."""
        experts = self.experts_now()
        if isinstance(experts, KernelExperts):
            return (self.gate.weight, *experts.gate_ups, *experts.downs)
        assert isinstance(experts, StackedExperts)
        return (self.gate.weight, experts.w13, experts.w2)

    def forward(
        self, x: torch.Tensor, lora: LoraContext | None = None, comm: TPComm | None = None
    ) -> torch.Tensor:
        if lora is not None:
            raise ValueError("LoRA adapters on a mixture-of-experts model are not supported")
        routing = self.route(F.linear(x, self.gate.weight), self.spec.top_k, self.spec.renormalize)
        out = grouped_moe(x, routing, self.experts_now())
        return summed_over_ranks(out, comm)


class MoeDecoderLayer(DecoderLayer):
    """``DecoderLayer`` whose feed-forward is a :class:`SparseMoeBlock` on the sparse layers,
    registered under the checkpoint's name (``mlp`` or ``block_sparse_moe``)."""

    def __init__(self, config: ModelConfig, layer: int, shard: RankShard | None = None) -> None:
        nn.Module.__init__(self)
        assert config.moe is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        spec = config.moe
        self.ffn_name = spec.block_name if spec.sparse_layers[layer] else "mlp"
        ffn = SparseMoeBlock(config, spec, shard) if spec.sparse_layers[layer] else MLP(config, layer, shard)
        self.add_module(self.ffn_name, ffn)

    def feed_forward(self) -> nn.Module:
        return self.get_submodule(self.ffn_name)


class MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` over :class:`MoeDecoderLayer`; always the per-op path."""

    LAYER = MoeDecoderLayer

    def no_native_layer(self) -> str | None:
        return f"{self.config.architecture}'s sparse experts are not part of the native decode call"

    def pack_layer(self, layer: DecoderLayer) -> None:
        """The attention's linears and the feed-forward's: a dense MLP's or the sparse experts' own packing."""
        store_for_matmul(layer.self_attn.output_linear())
        layer.self_attn.pack()
        ffn = layer.feed_forward()
        if isinstance(ffn, MLP):
            store_for_matmul(ffn.output_linear())
        assert isinstance(ffn, MLP | SparseMoeBlock)
        ffn.pack()

    def prepack(self, kind: str = "auto") -> str | None:
        """Not for the sparse model: its steps call the experts unpacked (None: none applied)."""
        return None
