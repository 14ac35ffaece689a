"""The shared decoder (Llama 2/3, Mistral, Qwen2, Qwen3) in plain torch, over one flat token batch.

Where it sits: the runner flattens a scheduler plan into ``input_ids`` and ``positions``
of shape (T,) plus one :class:`AttentionMetadata`, and calls :meth:`LlamaForCausalLM.forward`;
each attention layer writes its new K/V into its paged cache through the attention backend
and attends over the sequence's blocks. The LM head runs only at the rows that sample.

Submodule names follow the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj``
...) so ``state_dict`` keys are the safetensors names; the numerics follow transformers
(RMSNorm in float32, RoPE cos/sin in float32, rotate-half layout) so greedy output is
the same token for token. Each attention layer carries its own sliding window (None: full
causal attention) and hands it to the backend with the query. A family registered in
``registry.py`` with this class sets its differences in the config (q/k/v biases, Qwen3's
``qk_norm``: an RMSNorm over each q and k head before the rotary); a family whose layers differ
more builds its own class from these layers (``families/*.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from kvfleet.engine.attention import AttentionBackend, AttentionMetadata, LayerKV
from kvfleet.engine.kernels.fused_ops import add_rms_norm, add_rms_norm_reference, apply_rope, silu_mul
from kvfleet.engine.kernels.linear import Linear
from kvfleet.engine.kernels.packing import packs_model_dtype, resolve
from kvfleet.engine.kernels.packing.base import PackedWeight
from kvfleet.engine.kv.groups import kv_layout
from kvfleet.engine.layers.linear.packed import PackedFloatMethod
from kvfleet.engine.lora.context import DOWN_PROJ, GATE_UP, O_PROJ, QKV, LoraContext
from kvfleet.engine.model.config import ModelConfig
from kvfleet.engine.model.fused_layers import FusedLayers
from kvfleet.engine.model.projections import FLOAT_METHOD, ProjectedBlock, store_for_matmul
from kvfleet.engine.model.rope import dynamic_inv_freq, rope_frequencies
from kvfleet.engine.model.rope_scaling import rope_is_dynamic
from kvfleet.engine.model.tp import summed_over_ranks, vocab_parallel_embed

if TYPE_CHECKING:  # engine/parallel imports the model: named for the type checker only
    from kvfleet.engine.parallel.group import TPComm
    from kvfleet.engine.parallel.shard import RankShard

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm_reference(None, x, self.weight, self.eps)[0]

    def add_forward(
        self, x: torch.Tensor | None, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass (the native op on float32 CPU tensors).

        The sum may be written into ``residual`` in place: pass only a residual stream you own."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin at arbitrary positions: every token carries its own position, so no batch is padded.

    ``dynamic`` rope: transformers recomputes the frequencies in each forward from its largest
    position; here each token takes those of its own sequence's length after this step, which
    is what transformers computes when fed that sequence's steps one forward each.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        freqs = rope_frequencies(config)  # computed on the CPU; the buffer goes where the module is built
        self.register_buffer("inv_freq", freqs.inv_freq.to(torch.get_default_device()), persistent=False)
        self.inv_freq: torch.Tensor
        self.attention_scaling = freqs.attention_scaling
        self.dynamic = rope_is_dynamic(config)

    def reset_buffers(self, device: torch.device) -> None:
        """Recompute ``inv_freq`` (a non-persistent buffer, uninitialised after ``to_empty``)."""
        self.inv_freq = rope_frequencies(self.config).inv_freq.to(device)

    def forward(
        self, positions: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._per_token_inv_freq(meta) if self.dynamic else self.inv_freq[None, :]
        freqs = positions.float()[:, None] * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def _per_token_inv_freq(self, meta: AttentionMetadata) -> torch.Tensor:
        # Invariant: row r of sequence s gets the frequencies for length seq_lens[s]: the
        # load-time ones up to max_position_embeddings, the NTK-stretched ones beyond.
        limit = self.config.max_position_embeddings
        per_seq = [
            self.inv_freq if n <= limit else dynamic_inv_freq(self.config, n).to(self.inv_freq.device)
            for n in meta.seq_lens.tolist()
        ]
        query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
        return torch.stack(per_seq).repeat_interleave(query_lens, dim=0)


class Step(NamedTuple):
    """What every layer of one forward reads besides its rows and its cache."""

    rope: tuple[torch.Tensor, torch.Tensor]  # (cos, sin) at each row's position
    meta: AttentionMetadata
    backend: AttentionBackend
    comm: TPComm | None = None  # tensor parallelism: sums the row-parallel outputs; None at tp=1


class Attention(ProjectedBlock):
    INPUTS, OUTPUT = ("q_proj", "k_proj", "v_proj"), "o_proj"

    def __init__(self, config: ModelConfig, layer: int, shard: RankShard | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.sliding_window = config.layer_window(layer)
        self.kv_group = kv_layout(config.layer_windows, config.num_layers).group_of[layer]  # its block table
        h, d = config.hidden_size, config.head_dim
        heads, kv_heads, o_bias = config.num_heads, config.num_kv_heads, config.o_bias
        if shard is not None:  # this rank's whole KV-head groups; o_proj's bias added on one rank only
            heads = shard.q_heads.stop - shard.q_heads.start
            kv_heads = shard.kv_heads.stop - shard.kv_heads.start
            o_bias = o_bias and shard.holds_row_parallel_bias
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        self.q_proj = nn.Linear(h, heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(heads * d, h, bias=o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.scale = (config.query_pre_attn_scalar or d) ** -0.5
        self.sinks: nn.Parameter | None = None  # gpt-oss's per-head softmax logits (model/gpt_oss.py)

    def forward(
        self, x: torch.Tensor, kv_cache: torch.Tensor, step: Step, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The layer's attention output: for every row, or for the rows ``keep`` only (after the
        attention itself, which stores every row's K/V and sees every row)."""
        matmuls, (rope, meta, backend, _) = self.matmuls(), step
        t, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = matmuls.inputs(x)
        if meta.lora is not None:  # LoRA hook: each adapter's delta onto its token's q/k/v columns
            meta.lora.add(x, qkv, self.layer, QKV)
        # q and k heads side by side take the rotation in one call; v is a view of the rest.
        qk = qkv[:, : (heads + kv_heads) * d].unflatten(1, (heads + kv_heads, d))
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the rotary
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        qk = apply_rope(qk, *rope)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * d :].unflatten(1, (kv_heads, d))
        layer = LayerKV(kv_cache[0], kv_cache[1], self.scale, self.sliding_window, self.sinks)
        if self.kv_group:  # several KV cache groups (Gemma 3, gpt-oss): this layer's group's tables
            meta = meta.for_kv_group(self.kv_group)
        backend.store_kv(k, v, layer, meta.slot_mapping)
        out = backend.forward(q, layer, meta)
        attn = out.reshape(t, self.num_heads * self.head_dim)
        if keep is not None:
            attn = attn[keep]
        o = matmuls.output(attn)
        if meta.lora is not None:  # row-parallel: this rank's share of the delta, summed with o's
            meta.lora.add(attn, o, self.layer, O_PROJ)
        return summed_over_ranks(o, step.comm)


class MLP(ProjectedBlock):
    INPUTS, OUTPUT = ("gate_proj", "up_proj"), "down_proj"

    def __init__(self, config: ModelConfig, layer: int = 0, shard: RankShard | None = None) -> None:
        super().__init__()
        self.layer = layer
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        down_bias = bias
        if shard is not None:  # this rank's intermediate columns; down_proj's bias on one rank only
            i = shard.intermediate.stop - shard.intermediate.start
            down_bias = bias and shard.holds_row_parallel_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=down_bias)

    def forward(
        self, x: torch.Tensor, lora: LoraContext | None = None, comm: TPComm | None = None
    ) -> torch.Tensor:
        matmuls = self.matmuls()
        gate_up = matmuls.inputs(x)
        if lora is None:
            down = matmuls.output(silu_mul(gate_up))
        else:
            lora.add(x, gate_up, self.layer, GATE_UP)
            h = silu_mul(gate_up)
            down = matmuls.output(h)
            lora.add(h, down, self.layer, DOWN_PROJ)  # row-parallel: this rank's share, before the sum
        return summed_over_ranks(down, comm)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: RankShard | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer, shard)

    def feed_forward(self) -> nn.Module:
        """The layer's feed-forward block (``model/moe.py``'s sparse layers name theirs otherwise)."""
        return self.mlp

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        step: Step,
        residual: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next layer adds the two
        in its first norm, so each add rides along with a norm (``residual`` None: x is the stream).

        ``keep``: only these rows go on past the attention (the last layer, whose other rows
        nobody reads: their K/V is stored all the same). ``enter``, ``after_attention`` and ``leave``
        place the norms (``gemma3.py``'s sandwich them)."""
        h, residual = self.enter(x, residual)
        h = self.self_attn(h, kv_cache, step, keep)
        if keep is not None:
            residual = residual[keep]
        h, residual = self.after_attention(h, residual)
        return self.leave(self.feed_forward()(h, step.meta.lora, step.comm)), residual

    def enter(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, the stream): the previous layer's add rides along with the first norm."""
        if residual is None:
            return self.input_layernorm.add_forward(None, x)
        return self.input_layernorm.add_forward(x, residual)

    def after_attention(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the feed-forward's input, the stream with the attention added)."""
        return self.post_attention_layernorm.add_forward(h, residual)

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        """The feed-forward's output as the layer hands it on."""
        return out


def vocab_rows(config: ModelConfig, shard: RankShard | None) -> int:
    """The embedding's (and the LM head's) rows on this rank: its vocabulary slice under tensor parallelism."""
    return config.vocab_size if shard is None else shard.vocab.stop - shard.vocab.start


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        shard: RankShard | None = None,
        layer: type[DecoderLayer] = DecoderLayer,
        norm: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        # On the meta device (the loader's) Embedding's random init would run through torch._refs and
        # import torch._dynamo, over a second of every engine start: only real weights get it.
        weight = torch.empty(vocab_rows(config, shard), config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(weight.shape[0], config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(layer(config, i, shard) for i in range(config.num_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns float32 logits (len(sample_rows), vocab) for the rows that sample.

    Tensor parallelism (``shard`` and ``comm``, set by ``engine/parallel``): this rank's heads,
    intermediate columns and vocabulary slice only, an all-reduce after the embedding, o_proj and
    down_proj, and the LM head's vocabulary slices gathered on rank 0 (other ranks return their own
    slice, unread). The one-call native decode cannot hold an all-reduce: with ``comm`` it is off
    and every step runs the per-op path. ``LAYER``: the decoder layer a subclass builds
    (``model/moe.py``'s sparse one)."""

    LAYER: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: ModelConfig, shard: RankShard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.comm: TPComm | None = None  # set once the process group is up (tp > 1)
        self.model = self.decoder(config, shard)
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows(config, shard), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.packed_lm_head: PackedWeight | None = None  # packed by prepack(): decode batches over 16 rows
        self._lm_head: Linear | None = None  # resolved on first use; pack() and prepack() drop it
        self.fixed_lm_head: Linear | None = None  # resolved by a quantised loader's method: wins
        # Decode steps through one native call where it applies (model/fused_layers.py); built on first
        # use from the weights as (pre)packed then, as (the call or None,); pack() and prepack() drop it.
        self.use_fused_decode = True
        self._fused: tuple[FusedLayers | None] | None = None

    def decoder(self, config: ModelConfig, shard: RankShard | None) -> LlamaModel:
        """The embedding, layers, final norm and rotary (a family with its own layers overrides it)."""
        return LlamaModel(config, shard, self.LAYER)

    def reset_buffers(self, device: torch.device) -> None:
        """Recompute the rotary frequencies (non-persistent buffers, uninitialised after loading)."""
        self.model.rotary_emb.reset_buffers(device)

    def pack(self) -> None:
        """Pack each layer's q/k/v and gate/up linears into one matmul each (weights held once), and
        store every matmul's weight in :func:`matmul_layout`. A tied LM head stays tied while that
        layout is the stored one; column-major, it gets a copy of its own (the embedding looks
        rows up, which wants them contiguous)."""
        self._fused, self._lm_head = None, None
        with torch.no_grad():
            for layer in self.model.layers:
                assert isinstance(layer, DecoderLayer)
                self.pack_layer(layer)
            store_for_matmul(self.lm_head)

    def pack_layer(self, layer: DecoderLayer) -> None:
        """One layer's part of :meth:`pack` (a model whose feed-forward is not Llama's MLP packs its own)."""
        for block in (layer.self_attn, layer.mlp):
            store_for_matmul(block.output_linear())
            block.pack()

    def prepack(self, kind: str = "auto") -> str | None:
        """Pack every layer's matmul weights once for a GEMM library (float32 on the CPU, bfloat16
        on a CPU that computes it: ``packing.packs_model_dtype``; elsewhere a no-op): prefill-sized
        steps then skip the per-call copy ``F.linear`` makes. ``kind``: a
        packer of ``kernels/packing`` (``mkl``, ``onednn``) or ``auto``, the faster of them on
        this machine, timed on the first layer's gate/up weight. About one more copy of those
        weights in memory. The LM head is packed too (one more copy of the embedding when tied):
        a decode batch of more than 16 rows samples as many rows. Returns the packer used, None
        where none applied."""
        first = self.model.layers[0]
        assert isinstance(first, DecoderLayer)
        sample = first.mlp.fused_inputs().weight
        if sample.device.type != "cpu" or not packs_model_dtype(sample.dtype):
            return None
        chosen = resolve(kind, sample.detach())
        if chosen is None:
            return None
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.prepack(chosen)
            layer.mlp.prepack(chosen)
        self.packed_lm_head = PackedFloatMethod(packer=chosen).pack(self.lm_head.weight)
        self._fused, self._lm_head = None, None
        return chosen

    def lm_head_matmul(self) -> Linear:
        """The LM head's matmul as resolved for its weight as (pre)packed now."""
        if self.fixed_lm_head is not None:
            return self.fixed_lm_head
        if self._lm_head is None:
            self._lm_head = FLOAT_METHOD.process(self.lm_head.weight, None, self.packed_lm_head)
        return self._lm_head

    def no_native_layer(self) -> str | None:
        """Why this model's layers cannot run in the native decode call (None: they may)."""
        if self.config.qk_norm:
            return f"{self.config.architecture}'s q/k norms are not part of the native decode call"
        if any(
            isinstance(layer, DecoderLayer) and layer.self_attn.sinks is not None
            for layer in self.model.layers
        ):
            return f"{self.config.architecture}'s attention sinks are not part of the native decode call"
        return None

    def fused_decode(self) -> FusedLayers | None:
        """The native all-layers decode call for the weights as packed now (None: the per-op path)."""
        if not self.use_fused_decode or self.comm is not None or self.no_native_layer() is not None:
            return None
        if self._fused is None:
            layers = list(self.model.layers)
            self._fused = (FusedLayers.build(layers, self.config.hidden_size, self.config.intermediate_size),)
        return self._fused[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows' embeddings (under tensor parallelism each rank holds a slice of the vocabulary)."""
        if self.comm is not None:
            assert self.shard is not None
            return vocab_parallel_embed(self.model.embed_tokens, input_ids, self.shard, self.comm)
        x: torch.Tensor = self.model.embed_tokens(input_ids)
        return x

    def layer_steps(self, step: Step, positions: torch.Tensor, dtype: torch.dtype) -> list[Step]:
        """Each layer's ``Step``: the one for all here (``gemma3.py``'s sliding layers take their own rope)."""
        return [step] * len(self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        sample_rows: torch.Tensor,
        native: bool | None = None,
    ) -> torch.Tensor:
        """``native``: the step dispatcher's route (``engine/runner/step_dispatch.py``): the layers in one
        native call (True) or op by op (False); None (a caller without a route) tries the call."""
        comm, x = self.comm, self.embed(input_ids)
        rope = self.model.rotary_emb(positions, meta, x.dtype)
        residual: torch.Tensor | None = None
        # A prefill step's last layer runs o_proj and the MLP at the sampling rows only (with
        # LoRA every row goes on: the adapter context is per row).
        prune = meta.lora is None and sample_rows.shape[0] < input_ids.shape[0]
        last_layer = len(self.model.layers) - 1
        fused = None if native is False else self.fused_decode()
        done = None if fused is None else fused.run(x, rope, kv_caches, meta, backend, sample_rows)
        if done is None and native:  # the dispatcher's plan-level checks passed, the call's own did not
            log.warning("the step dispatcher chose the native call, which refused the step: per-op")
        if done is not None:  # every row decodes and samples (prune is False): all layers in one call
            x, residual = done
        else:
            steps = self.layer_steps(Step(rope, meta, backend, comm), positions, x.dtype)
            for i, (layer, kv_cache, step) in enumerate(
                zip(self.model.layers, kv_caches, steps, strict=True)
            ):
                keep = sample_rows if prune and i == last_layer else None
                x, residual = layer(x, kv_cache, step, residual, keep)
        if prune:
            last = x if residual is None else x + residual
        else:
            last = x[sample_rows] if residual is None else x[sample_rows] + residual[sample_rows]
        logits = self.lm_head_matmul()(self.model.norm(last)).float()
        return logits if comm is None else comm.gather_vocab(logits)
